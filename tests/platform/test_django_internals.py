"""The Django internals the API's bare handler relies on
(roundhouse/bare_handler.py: DJANGO_INTERNALS) are there in the installed
Django, with the parameters the handler calls them with: a Django upgrade that
renames or reshapes one fails here first, by name, instead of as a broken
front."""

import inspect
import re

import pytest
from django.core.handlers.asgi import ASGIHandler

from roundhouse.bare_handler import DJANGO_INTERNALS, BareASGIHandler


@pytest.mark.parametrize(
    ("owner", "name", "use", "parameters"),
    DJANGO_INTERNALS,
    ids=[f"{use} {name}" for _, name, use, _ in DJANGO_INTERNALS],
)
def test_each_internal_the_handler_relies_on_is_there(owner, name, use, parameters):
    if parameters is None:  # an attribute the handler sets: Django sets it too
        handler = ASGIHandler()  # its __init__ loads the middleware
        assert hasattr(handler, name), f"Django's handler no longer sets {name}"
        return
    found = getattr(owner, name, None)
    assert callable(found), f"Django's {owner.__name__} has no {name} any more"
    assert tuple(inspect.signature(found).parameters) == parameters, name


def test_the_list_names_every_internal_the_handler_touches():
    """Every private attribute of Django's handler that the bare handler's
    source uses is in DJANGO_INTERNALS (control: one left out is found)."""
    source = inspect.getsource(BareASGIHandler)
    listed = {name for _, name, _, _ in DJANGO_INTERNALS}
    used = {
        name
        for name in dir(ASGIHandler())
        if name.startswith("_")
        and not name.startswith("__")
        and re.search(rf"self\.{name}\b", source)
    }
    assert used <= listed, used - listed
    assert "_middleware_chain" in used  # the check sees what the handler sets
