"""`manage.py create_api_key NAME`: create an API key and print it, once."""

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from api.selectors import model_configs_by_name
from api.services import api_key_create


class Command(BaseCommand):
    help = (
        "Create an API key for the OpenAI-compatible API and print it. Only its "
        "hash is stored: the key is shown this once."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="What the key is for (shown in the admin).")
        parser.add_argument("--owner", help="Username of the key's owner.")
        parser.add_argument(
            "--models", default="", help="Comma-separated model names. Default: all."
        )
        parser.add_argument("--rpm", type=int, default=0, help="0: unlimited.")
        parser.add_argument(
            "--max-concurrent", type=int, default=0, help="0: unlimited."
        )

    def handle(self, *args, name: str, owner: str | None, models: str, **options):
        user = None
        if owner:
            user = get_user_model().objects.filter(username=owner).first()
            if user is None:
                raise CommandError(f"No user named {owner!r}.")
        names = [item.strip() for item in models.split(",") if item.strip()]
        found = model_configs_by_name(names=names)
        missing = [item for item in names if item not in found]
        if missing:
            raise CommandError(f"Unknown model(s): {', '.join(missing)}.")
        try:
            key, plaintext = api_key_create(
                name=name,
                owner=user,
                allowed_models=found.values(),
                rpm_limit=options["rpm"],
                max_concurrent=options["max_concurrent"],
            )
        except ValidationError as error:
            raise CommandError("; ".join(error.messages)) from error
        self.stdout.write(f"Created API key {key.name!r} ({key.prefix}…):")
        self.stdout.write(plaintext)
        self.stdout.write(
            self.style.WARNING("It is shown only this once: copy it now.")
        )
