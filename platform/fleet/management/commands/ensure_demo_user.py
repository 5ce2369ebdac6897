"""Create the demo staff user once; its password is printed only at creation."""

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Create the demo admin user (ROUNDHOUSE_ADMIN_USER) if missing, with the "
        "password from ROUNDHOUSE_ADMIN_PASSWORD or a generated one printed once."
    )

    def handle(self, *args, **options) -> None:
        users = get_user_model()
        username = settings.ROUNDHOUSE_ADMIN_USER
        password = settings.ROUNDHOUSE_ADMIN_PASSWORD
        user = users.objects.filter(username=username).first()
        if user is not None:
            if password and not user.check_password(password):
                user.set_password(password)
                user.save(update_fields=["password"])
                self.stdout.write(f"Password of {username!r} set from the environment.")
            return
        generated = not password
        password = password or secrets.token_urlsafe(12)
        users.objects.create_superuser(username=username, password=password, email="")
        if generated:
            self.stdout.write(
                self.style.WARNING(
                    f"Created admin user {username!r} with password {password}\n"
                    "It is shown only this once; set ROUNDHOUSE_ADMIN_PASSWORD to "
                    "choose your own."
                )
            )
        else:
            self.stdout.write(f"Created admin user {username!r} (password from env).")
