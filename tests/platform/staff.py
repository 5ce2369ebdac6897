"""Staff members with some of the admin's permissions, as the permission tests
and the dashboard's make them."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

VIEW = ["catalog.view_modelconfig", "batches.view_batch", "fleet.view_enginespec"]


CHANGE = [
    "catalog.add_modelconfig",
    "catalog.change_modelconfig",
    "batches.change_batch",
    "fleet.change_enginespec",
]


def staff_member(name: str, permissions: list[str]):
    """A new staff member (not a superuser) holding `permissions`
    ("app.codename")."""
    user = get_user_model().objects.create_user(name, is_staff=True)
    for permission in permissions:
        app, codename = permission.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return user
