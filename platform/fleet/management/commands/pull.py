"""`manage.py pull hf:ORG/REPO[:QUANT | /FILE] [--name NAME] [--node NODE]` (or
`manage.py pull https://HOST/PATH/NAME.gguf --sha256 SHA256`): a model from
the Hugging Face Hub or an address, like `ollama pull`: what it is and what it
needs before the download, a progress line while it comes, its catalog row
after. Here, it downloads in this process: Ctrl-C stops it and the next run
continues where it stopped. With --node, the pull is a job on that node's
queue (its worker downloads): the command follows its progress, and Ctrl-C
stops following, not the pull; a second run follows the same pull. On a
cluster without --node, it is such a job on the node where the model's first
replica is placed (fleet.pull_node), which the command says."""

import sys
import time
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from catalog.hub import HubError
from catalog.models import PULL_OPEN, ModelPull, PullStatus
from catalog.pull import Progress, PullPlan, pull_files, pull_plan, pull_record
from catalog.pull_jobs import pull_start
from catalog.pull_progress import pulls_with_db_now, rate_now, stalled_s, stalled_text
from cluster.models import Node
from fleet.pull_node import cluster_joined, pull_node_default

MIB = 1 << 20
# A pull on a node is looked at this often while it is followed.
FOLLOW_EVERY_S = 0.5


class Command(BaseCommand):
    help = "Pull a model from the Hugging Face Hub and add it to the catalog."
    # The system checks load every URLconf and admin: seconds before a byte.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "source",
            help="hf:ORG/REPO[:QUANTIZATION | /FILE], or https://HOST/PATH/NAME.gguf "
            "with --sha256",
        )
        parser.add_argument("--name", default="", help="The model's name (alias).")
        parser.add_argument("--revision", default="main", help="Branch, tag or commit.")
        parser.add_argument(
            "--sha256",
            default="",
            help="The file's expected SHA-256 (an https:// source needs it).",
        )
        parser.add_argument(
            "--node",
            default="",
            help="Pull on this node of the cluster (its worker downloads); "
            "the other nodes copy it from there when it is placed on them. "
            "Default on a cluster: the node where its first replica is placed.",
        )

    def handle(
        self,
        *args,
        source: str,
        name: str,
        revision: str,
        node: str,
        sha256: str = "",
        **options,
    ) -> None:
        try:
            if node or cluster_joined():
                model = self.on_node(
                    source, name=name, revision=revision, node=node, sha256=sha256
                )
            else:
                plan = pull_plan(source, name=name, revision=revision, sha256=sha256)
                self.describe(plan)
                path = pull_files(
                    plan, Path(settings.MODELS_DIR), progress=self.progress
                )
                sys.stderr.write("\n")
                model = pull_record(plan, path)
        except HubError as error:
            raise CommandError(error.message) from None
        except ValidationError as error:
            raise CommandError(f"the catalog refused the model: {error}") from None
        self.stdout.write(f"added model {model.name} ({model.task}): {model.path}")

    def describe(self, plan: PullPlan) -> None:
        """What the pull fetches and what the model is and needs."""
        origin = plan.url or f"{plan.repo_id}@{plan.commit[:12]}"
        files = (
            f"{len(plan.files)} files"
            if len(plan.files) > 2
            else (" + ".join(f.name for f in plan.files))
        )
        parameters = sum(plan.parameters.values())
        counted = (
            f", {parameters / 1e6:.1f}M parameters ({', '.join(plan.parameters)})"
            if parameters
            else ""
        )
        self.stdout.write(
            f"{origin} {files}: {plan.size / MIB:.0f} MiB, {plan.format} "
            f"{plan.architecture}{counted}, {plan.task}, trained context "
            f"{plan.context_length}; needs {plan.needs_mib:.0f} MiB served at its "
            "default context"
        )

    def on_node(
        self, source: str, *, name: str, revision: str, node: str, sha256: str = ""
    ):
        """Start the pull on the node, or without one where the model's first
        replica is placed (or follow the one under way with this source and
        name), and follow it to its end."""
        if (
            node
            and not Node.objects.filter(name=node, revoked_at__isnull=True).exists()
        ):
            raise HubError(404, f"no node named {node} (Fleet > Nodes)")
        pull = (
            ModelPull.objects.filter(
                source=source,
                status__in=PULL_OPEN,
                **({"node": node} if node else {}),
                **({"name": name} if name else {}),
            )
            .order_by("-created_at")
            .first()
        )
        if pull is None:
            pull = pull_start(
                source=source,
                name=name,
                revision=revision,
                sha256=sha256,
                node=node,
                node_default=pull_node_default,
            )
            if pull.node_reason:
                self.stdout.write(f"pulling on {pull.node_reason}")
        else:
            self.stdout.write(f"following pull {pull.pk}, under way on {_on(pull)}")
        self.describe(PullPlan.model_validate(pull.plan))
        followed = pulls_with_db_now(ModelPull.objects.filter(pk=pull.pk))
        try:
            while pull.status in PULL_OPEN:
                time.sleep(FOLLOW_EVERY_S)
                pull = followed.get()
                rate, left = rate_now(pull)
                quiet = stalled_s(pull)
                self.show(
                    pull.done_bytes,
                    pull.size_bytes,
                    rate,
                    left,
                    quiet=stalled_text(quiet) if quiet is not None else "",
                )
        except KeyboardInterrupt:
            raise CommandError(
                f"stopped following: pull {pull.pk} goes on on {_on(pull)}; run "
                "the same command to follow it again, or cancel it in the admin"
            ) from None
        sys.stderr.write("\n")
        if pull.status != PullStatus.DONE:
            raise HubError(500, f"pull {pull.pk} {pull.status}: {pull.message}")
        return pull.model

    def progress(self, progress: Progress) -> None:
        self.show(progress.done, progress.size, progress.rate, progress.left_s)

    def show(
        self,
        done: int,
        size: int,
        rate: float,
        left_s: float | None,
        *,
        quiet: str = "",
    ) -> None:
        """The progress line, redrawn: `quiet` says it has stalled."""
        left = f", {left_s:.0f} s left" if left_s is not None else ""
        how = quiet or f"{rate / MIB:.1f} MiB/s{left}"
        sys.stderr.write(f"\r{done / MIB:.0f}/{size / MIB:.0f} MiB ({how})   ")


def _on(pull: ModelPull) -> str:
    """Where a pull runs, as the command says it."""
    return f"node {pull.node}" if pull.node else "a worker"
