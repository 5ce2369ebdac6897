"""Place the bundled demo models in the models directory (idempotent)."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from catalog.bundled import BUNDLED_MODELS


class Command(BaseCommand):
    help = "Copy or assemble the bundled models into ROUNDHOUSE_MODELS_DIR."

    def handle(self, *args, **options) -> None:
        models_dir = Path(settings.MODELS_DIR)
        models_dir.mkdir(parents=True, exist_ok=True)
        for model in BUNDLED_MODELS:
            try:
                if model.is_installed(models_dir):
                    continue
                self.stdout.write(f"==> installing {model.name} into {models_dir}")
                model.install(models_dir / model.filename)
            except (LookupError, OSError, ValueError) as error:
                raise CommandError(f"cannot install {model.name}: {error}") from error
