"""`manage.py pull hf:ORG/REPO[:QUANT | /FILE] [--name NAME]`: a GGUF model
from the Hugging Face Hub, like `ollama pull`: what it is and what it needs
before the download, a progress line while it comes, its catalog row after.
Ctrl-C stops it; the next run continues where it stopped."""

import sys
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from catalog.hub import HubError
from catalog.pull import Progress, pull_file, pull_plan, pull_record

MIB = 1 << 20


class Command(BaseCommand):
    help = "Pull a GGUF model from the Hugging Face Hub and add it to the catalog."

    def add_arguments(self, parser) -> None:
        parser.add_argument("source", help="hf:ORG/REPO[:QUANTIZATION | /FILE]")
        parser.add_argument("--name", default="", help="The model's name (alias).")
        parser.add_argument("--revision", default="main", help="Branch, tag or commit.")

    def handle(self, *args, source: str, name: str, revision: str, **options) -> None:
        try:
            plan = pull_plan(source, name=name, revision=revision)
            facts = plan.facts
            self.stdout.write(
                f"{plan.repo.repo_id}@{plan.repo.commit[:12]} {plan.file.name}: "
                f"{plan.file.size / MIB:.0f} MiB, {facts.architecture}, "
                f"{facts.task}, trained context {facts.context_length}; needs "
                f"{facts.needs_mib():.0f} MiB served at its default context"
            )
            path = pull_file(
                plan.repo, plan.file, Path(settings.MODELS_DIR), progress=self.progress
            )
            sys.stderr.write("\n")
            model = pull_record(plan, path)
        except HubError as error:
            raise CommandError(error.message) from None
        except ValidationError as error:
            raise CommandError(f"the catalog refused the model: {error}") from None
        self.stdout.write(f"added model {model.name} ({model.task}): {model.path}")

    def progress(self, progress: Progress) -> None:
        left = f", {progress.left_s:.0f} s left" if progress.left_s is not None else ""
        sys.stderr.write(
            f"\r{progress.done / MIB:.0f}/{progress.size / MIB:.0f} MiB "
            f"({progress.rate / MIB:.1f} MiB/s{left})   "
        )
