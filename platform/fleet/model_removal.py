"""Deleting a model from the catalog (DELETE /v1/models/{name}): refused
while the model is in use anywhere, then its files deleted from this host
(fleet.disk.model_files_delete, which refuses too while it is in use here),
then its row.

fleet.disk judges this host alone, which is right for deleting files from one
node; a model leaving the catalog must not be in use on any node: loaded in
an engine that is up (EngineState.resident_models, as the supervisors last
saw them), or, on a cluster, with a replica placed on a node's engine (that
node's supervisor keeps it loaded). On a one-host platform a model is loaded
when asked for, not kept: only its being loaded counts, as in fleet.disk."""

from catalog.models import ModelConfig
from fleet.disk import DOWN, ModelInUse, model_files_delete
from fleet.models import EngineState
from fleet.selectors import routing_snapshot

__all__ = ["ModelInUse", "model_delete", "model_use_anywhere"]


def model_use_anywhere(*, model: ModelConfig) -> str:
    """Where the model is loaded or placed, on any node, in words ("loaded
    on cpu0 (node b)", "placed on gpu1 (node a, replica 1)"); "" when
    nowhere."""
    states = EngineState.objects.select_related("spec", "spec__node")
    for state in states.order_by("spec__order", "spec__name"):
        if state.status not in DOWN and model.name in state.resident_model_names:
            node = state.spec.node
            return f"loaded on {state.spec.name}" + (
                f" (node {node.name})" if node else ""
            )
    snapshot = routing_snapshot()
    for replica, engine in enumerate(snapshot.placed(model.name), start=1):
        node = snapshot.engines[engine].node
        if node:
            return f"placed on {engine} (node {node}, replica {replica})"
    return ""


def model_delete(*, model: ModelConfig) -> int:
    """Delete the model's files from this host, then its row; the bytes
    freed. ModelInUse, with where, while it is loaded or placed anywhere:
    nothing is deleted then."""
    use = model_use_anywhere(model=model)
    if use:
        raise ModelInUse(f"{model.name} is {use}")
    freed = model_files_delete(model=model)
    model.delete()
    return freed
