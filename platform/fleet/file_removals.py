"""Deleting a model's files from another node of the cluster, through the
node's row (no table, no message between hosts of its own).

The front asks (`files_removal_request`): it refuses at once a model loaded on
an engine of the node or placed there (ModelInUse, the reason, as the node
would), else records the request in the node's `file_removals` (model name ->
its path as the catalog has it, and when it was asked). At each heartbeat the
node's supervisor (`files_removals_follow`) carries out each request it has
not answered yet, with fleet/disk.py's `model_files_delete` (only under its
MODELS_DIR, never another model's file, refused while loaded or placed
there), and writes the outcome in its own `files_removed` (the request it
answers, the bytes freed or why it refused, when): the one column of its row
its database role may write for this (node_database.NODE_COLUMNS), never the
requests. A request is answered once; asking again (a later `requested_at`)
is a new request. Node.file_removal_states() is what the front shows of it:
pending, done or refused, per model.

Nothing is ever deleted by a path from the row alone: the node deletes the
catalog's model of that name, and refuses when the catalog has no such model
any more or its path changed since the request.
"""

import logging
from datetime import UTC, datetime

from django.db import InterfaceError, OperationalError, transaction

from catalog.models import ModelConfig
from cluster.models import Node

from .disk import ModelInUse, model_files_delete, model_in_use_here

log = logging.getLogger("roundhouse.fleet")

# The database gone for a moment: the request is left unanswered (tried again
# at the next heartbeat), not refused for good.
UNAVAILABLE = (OperationalError, InterfaceError)
NO_SUCH_MODEL = "no such model in the catalog"


class RemovalRefused(Exception):
    """A removal that cannot be asked of this node (revoked: its supervisor
    stopped); str() is the reason."""


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


# -- the front -----------------------------------------------------------------------


def files_removal_request(*, node: Node, model: ModelConfig) -> str:
    """Ask `node` to delete the model's files (its supervisor does within a
    heartbeat or two); the request's `requested_at`. ModelInUse, the reason,
    while an engine of the node holds the model or its replica is placed
    there; RemovalRefused for a revoked node. Asking again replaces an
    earlier request for the model (answered again)."""
    if node.revoked_at is not None:
        raise RemovalRefused(f"node {node.name} is revoked: its supervisor stopped")
    in_use = model_in_use_here(model=model, node=node.name)
    if in_use:
        raise ModelInUse(f"{model.name} is {in_use}")
    requested_at = _now_iso()
    with transaction.atomic():
        row = Node.objects.select_for_update().only("pk", "file_removals")
        requests = dict(row.get(pk=node.pk).file_removals or {})
        requests[model.name] = {"path": model.path, "requested_at": requested_at}
        Node.objects.filter(pk=node.pk).update(file_removals=requests)
    node.file_removals = requests
    return requested_at


# -- the node ------------------------------------------------------------------------


def files_removals_follow(*, node_name: str) -> dict | None:
    """On the node's supervisor, at each heartbeat: read its own row's
    removals asked and answered (one small read) and carry out the new ones
    (files_removals_carry_out); the new `files_removed`, or None when nothing
    was new."""
    row = (
        Node.objects.filter(name=node_name, revoked_at__isnull=True)
        .values_list("file_removals", "files_removed")
        .first()
    )
    if row is None:
        return None
    requests, done = row
    return files_removals_carry_out(
        node_name=node_name, requests=requests or {}, done=done or {}
    )


def files_removals_carry_out(
    *, node_name: str, requests: dict, done: dict
) -> dict | None:
    """Carry out on this host (node `node_name`) each request not answered
    in `done` yet (the same `requested_at`), each model alone (any error
    refuses that one, with the message), and write the outcomes to the
    node's own `files_removed`; those outcomes, or None when every request
    was answered already (nothing written)."""
    answered = dict(done) if isinstance(done, dict) else {}
    changed = False
    for name, request in sorted((requests or {}).items()):
        requested_at = request.get("requested_at") if isinstance(request, dict) else ""
        if not requested_at:
            continue  # not a request the front writes
        outcome = answered.get(name)
        if isinstance(outcome, dict) and outcome.get("requested_at") == requested_at:
            continue  # answered already
        try:
            freed, refused = _carry_out(node_name, name, request)
        except UNAVAILABLE as error:
            log.warning("file removal of %s left for later: %s", name, error)
            continue
        answered[name] = {
            "requested_at": requested_at,
            "freed": freed,
            "refused": refused,
            "at": _now_iso(),
        }
        changed = True
    if not changed:
        return None
    Node.objects.filter(name=node_name, revoked_at__isnull=True).update(
        files_removed=answered
    )
    return answered


def _carry_out(node_name: str, name: str, request: dict) -> tuple[int, str]:
    """Delete one model's files here: (bytes freed, "") or (0, why not)."""
    try:
        model = ModelConfig.objects.filter(name=name).first()
        if model is None:
            return 0, NO_SUCH_MODEL
        if request.get("path") != model.path:
            return 0, (
                f"its path changed since the request (asked for "
                f"{request.get('path')!r}, now {model.path!r}): ask again"
            )
        in_use = model_in_use_here(model=model, node=node_name)
        if in_use:
            return 0, f"{name} is {in_use}"
        freed = model_files_delete(model=model)
    except UNAVAILABLE:
        raise
    except ModelInUse as in_use:
        return 0, str(in_use)
    except Exception as error:  # noqa: BLE001 - that model alone
        log.exception("the removal of %s's files failed", name)
        return 0, f"{type(error).__name__}: {error}"
    log.info("deleted model %s's files from node %s: %d bytes", name, node_name, freed)
    return freed, ""
