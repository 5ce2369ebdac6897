"""api.selectors.user_allowance: a logged-in user's limits (the admin's User
limits, or the user's own), remembered for a few seconds, and kept while the
database fails."""

import types

import pytest
from django import db
from django.contrib.auth import get_user_model

from api import selectors
from api.models import UserLimitOverride, UserLimits
from api.selectors import USER_LIMITS_FRESH_S, user_allowance, user_allowances_forget

pytestmark = pytest.mark.django_db


@pytest.fixture
def monotonic(monkeypatch) -> types.SimpleNamespace:
    """The selectors' monotonic clock, at `monotonic.now` seconds."""
    fake = types.SimpleNamespace(now=1000.0)
    fake.monotonic = lambda: fake.now
    monkeypatch.setattr(selectors, "time", fake)
    return fake


def user_named(username: str):
    return get_user_model().objects.create_user(username)


def own_limits(user, *, rpm_limit: int, max_concurrent: int) -> UserLimitOverride:
    return UserLimitOverride.objects.create(
        defaults=UserLimits.load(),
        user=user,
        rpm_limit=rpm_limit,
        max_concurrent=max_concurrent,
    )


def test_a_user_without_an_override_has_the_defaults():
    """No row yet: the defaults (60 a minute, 4 at once), in the user's own
    counters (scope u<pk>), named "your account" in refusals; the defaults
    saved in the admin replace them."""
    ada = user_named("ada")
    allowance = user_allowance(user_id=ada.pk)
    assert (allowance.rpm_limit, allowance.max_concurrent) == (60, 4)
    assert allowance.scope == f"u{ada.pk}" and allowance.who == "your account"
    defaults = UserLimits.load()
    defaults.rpm_limit, defaults.max_concurrent = 10, 1
    defaults.save()
    user_allowances_forget()
    allowance = user_allowance(user_id=ada.pk)
    assert (allowance.rpm_limit, allowance.max_concurrent) == (10, 1)


def test_an_override_replaces_the_defaults_for_its_user_only():
    """A user's own limits (0: unlimited) are theirs; another user keeps the
    defaults."""
    ada, bob = user_named("ada"), user_named("bob")
    own_limits(ada, rpm_limit=0, max_concurrent=16)
    mine, theirs = user_allowance(user_id=ada.pk), user_allowance(user_id=bob.pk)
    assert (mine.rpm_limit, mine.max_concurrent) == (0, 16)
    assert (theirs.rpm_limit, theirs.max_concurrent) == (60, 4)
    assert mine.scope != theirs.scope


def test_limits_are_remembered_for_a_few_seconds(monotonic, django_assert_num_queries):
    """Read once, the limits are answered without a query until
    USER_LIMITS_FRESH_S has passed; then a change is seen."""
    ada = user_named("ada")
    assert user_allowance(user_id=ada.pk).max_concurrent == 4
    own_limits(ada, rpm_limit=1, max_concurrent=2)
    monotonic.now += USER_LIMITS_FRESH_S - 0.1
    with django_assert_num_queries(0):
        assert user_allowance(user_id=ada.pk).max_concurrent == 4
    monotonic.now += 0.2
    assert user_allowance(user_id=ada.pk).max_concurrent == 2


@pytest.mark.django_db(transaction=True)
def test_while_the_database_fails_the_last_limits_read_hold(monotonic, outage):
    """A user read before the outage keeps their last limits after they are
    stale; a user never read cannot be admitted (db.Error, which the pipeline
    turns into a 503). Once the database is back, limits are read again."""
    ada, bob = user_named("ada"), user_named("bob")
    own_limits(ada, rpm_limit=3, max_concurrent=3)
    assert user_allowance(user_id=ada.pk).max_concurrent == 3
    outage.start()
    monotonic.now += USER_LIMITS_FRESH_S + 1
    assert user_allowance(user_id=ada.pk).max_concurrent == 3
    with pytest.raises(db.Error):
        user_allowance(user_id=bob.pk)
    outage.end()
    UserLimitOverride.objects.filter(user=ada).update(max_concurrent=5)
    assert user_allowance(user_id=ada.pk).max_concurrent == 5
    assert user_allowance(user_id=bob.pk).max_concurrent == 4
