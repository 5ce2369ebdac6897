"""API keys and usage in the admin: the key is shown once, usage is read-only;
users' limits: the defaults and each user's own, on one page."""

import hashlib
import io
import logging
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.urls import reverse

from api.models import ApiKey, Usage, UserLimitOverride, UserLimits
from api.selectors import user_allowance
from tests.factories import ApiKeyFactory, ModelConfigFactory, UsageFactory

pytestmark = pytest.mark.django_db

KEY_PATTERN = re.compile(r"rh-[A-Za-z0-9_-]{40,}")


def add_key(admin_client, **fields):
    data = {"name": "ci", "owner": "", "rpm_limit": "60", "max_concurrent": "2"}
    data.update(fields)
    return admin_client.post(reverse("admin:api_apikey_add"), data)


def test_add_form_does_not_ask_for_the_key(admin_client):
    """The add form has the key's settings, no field for the key or its hash."""
    page = admin_client.get(reverse("admin:api_apikey_add")).content.decode()
    assert 'name="name"' in page and 'name="rpm_limit"' in page
    assert 'name="key_hash"' not in page and 'name="prefix"' not in page


def test_added_key_is_shown_once_and_only_its_hash_stored(admin_client, caplog):
    """Saving a new key shows it once in a message; it is in no later page, no
    row, no dump and no log line, and its SHA-256 is what is stored."""
    chat = ModelConfigFactory()
    caplog.set_level(logging.DEBUG)
    response = add_key(admin_client, allowed_models=[chat.pk])
    assert response.status_code == 302

    messages = [str(m) for m in get_messages(response.wsgi_request)]
    [message] = [m for m in messages if "will not be shown again" in m]
    plaintext = KEY_PATTERN.search(message).group()
    assert sum(plaintext in m for m in messages) == 1
    key = ApiKey.objects.get()
    assert key.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert plaintext.startswith(key.prefix)
    assert list(key.allowed_models.all()) == [chat]
    assert (key.rpm_limit, key.max_concurrent) == (60, 2)

    assert plaintext in admin_client.get(response.url).content.decode()
    change_url = reverse("admin:api_apikey_change", args=[key.pk])
    for url in (response.url, change_url):
        page = admin_client.get(url).content.decode()
        assert plaintext not in page
        assert key.key_hash not in page
    assert key.prefix in page

    dump = io.StringIO()
    call_command("dumpdata", stdout=dump)
    assert plaintext not in dump.getvalue()
    assert plaintext not in caplog.text


def test_change_keeps_the_hash(admin_client):
    """Editing a key's limits keeps its secret."""
    key = ApiKeyFactory(rpm_limit=5)
    url = reverse("admin:api_apikey_change", args=[key.pk])
    data = {"name": "renamed", "owner": "", "rpm_limit": "7", "max_concurrent": "0"}
    response = admin_client.post(url, data)
    assert response.status_code == 302
    stored = ApiKey.objects.get(pk=key.pk)
    assert (stored.name, stored.rpm_limit) == ("renamed", 7)
    assert stored.key_hash == key.key_hash
    messages = [str(m) for m in get_messages(response.wsgi_request)]
    assert not [m for m in messages if "shown again" in m or key.plaintext in m]


def test_revoke_action(admin_client):
    """ "Revoke selected keys" revokes the selected keys and no other."""
    chosen, other = ApiKeyFactory.create_batch(2)
    response = admin_client.post(
        reverse("admin:api_apikey_changelist"),
        {"action": "revoke_keys", "_selected_action": [chosen.pk]},
    )
    assert response.status_code == 302
    assert ApiKey.objects.get(pk=chosen.pk).revoked
    assert not ApiKey.objects.get(pk=other.pk).revoked
    assert "Revoked 1 key(s)." in [str(m) for m in get_messages(response.wsgi_request)]
    # The admin's history of the key records it; the other key has none.
    entry = LogEntry.objects.get(object_id=str(chosen.pk))
    assert entry.change_message == "Revoked." and entry.is_change()
    assert not LogEntry.objects.filter(object_id=str(other.pk)).exists()


def test_key_list_shows_usage_totals(admin_client):
    """The key list shows each key's requests and tokens, summed from its usage."""
    busy, idle = ApiKeyFactory.create_batch(2)
    UsageFactory(key=busy, prompt_tokens=10, completion_tokens=5)
    UsageFactory(key=busy, prompt_tokens=7, completion_tokens=0, status=500)
    UsageFactory(key=None, prompt_tokens=1000)

    response = admin_client.get(reverse("admin:api_apikey_changelist"))
    assert response.status_code == 200
    totals = {
        key.pk: (
            key.request_count,
            key.prompt_tokens_total,
            key.completion_tokens_total,
        )
        for key in response.context["cl"].result_list
    }
    assert totals == {busy.pk: (2, 17, 5), idle.pk: (0, 0, 0)}
    page = response.content.decode()
    assert busy.prefix in page and busy.key_hash not in page

    ordered = admin_client.get(reverse("admin:api_apikey_changelist") + "?o=9")
    assert ordered.status_code == 200


def test_deleting_a_key_keeps_its_usage(admin_client):
    """A deleted key's usage rows stay, without their key."""
    usage = UsageFactory()
    response = admin_client.post(
        reverse("admin:api_apikey_changelist"),
        {
            "action": "delete_selected",
            "_selected_action": [usage.key_id],
            "post": "yes",
        },
    )
    assert response.status_code == 302
    assert not ApiKey.objects.exists()
    assert Usage.objects.get(pk=usage.pk).key is None


@pytest.mark.parametrize(
    "query",
    [
        "",
        "?key__id__exact={key}",
        "?model=model-b",
        "?engine=cuda0",
        "?status=429",
        "?endpoint=embeddings",
        "?created_at__year={year}",
        "?key__isnull=True",
    ],
)
def test_usage_list_and_filters(admin_client, query):
    """The usage list and each of its filters render."""
    usage = UsageFactory(model="model-b", engine="cuda0", status=429)
    UsageFactory(endpoint="embeddings")
    url = reverse("admin:api_usage_changelist") + query.format(
        key=usage.key_id, year=usage.created_at.year
    )
    response = admin_client.get(url)
    assert response.status_code == 200


def test_usage_filter_selects_rows(admin_client):
    """Filtering by model shows only that model's rows."""
    UsageFactory(model="model-b")
    UsageFactory(model="model-c")
    response = admin_client.get(
        reverse("admin:api_usage_changelist") + "?model=model-b"
    )
    assert [usage.model for usage in response.context["cl"].result_list] == ["model-b"]


def test_usage_is_read_only(admin_client):
    """Usage rows can be viewed, not added, changed or deleted."""
    usage = UsageFactory()
    assert admin_client.get(reverse("admin:api_usage_add")).status_code == 403
    change_url = reverse("admin:api_usage_change", args=[usage.pk])
    page = admin_client.get(change_url)
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert admin_client.post(change_url, {"status": "200"}).status_code == 403
    delete_url = reverse("admin:api_usage_delete", args=[usage.pk])
    assert admin_client.post(delete_url, {"post": "yes"}).status_code == 403
    assert Usage.objects.get(pk=usage.pk).status == usage.status


def user_limits_form(defaults: UserLimits, *overrides: dict, initial: int = 0) -> dict:
    """The User limits change form's fields: the defaults, then these
    overrides (each with its user, rpm_limit and max_concurrent; `id` for one
    already saved)."""
    data = {
        "rpm_limit": str(defaults.rpm_limit),
        "max_concurrent": str(defaults.max_concurrent),
        "overrides-TOTAL_FORMS": str(len(overrides)),
        "overrides-INITIAL_FORMS": str(initial),
        "overrides-MIN_NUM_FORMS": "0",
        "overrides-MAX_NUM_FORMS": "1000",
    }
    for index, override in enumerate(overrides):
        for name, value in override.items():
            data[f"overrides-{index}-{name}"] = str(value)
    return data


def test_user_limits_page_edits_the_defaults_and_users_own_limits(admin_client):
    """The list of User limits opens its one row, with the defaults (rpm 60,
    4 at once) and an inline of users' own limits. Saving new defaults and an
    override takes effect at once in this process (user_allowance); changing
    and deleting the override work the same way."""
    ada = get_user_model().objects.create_user("ada")
    bob = get_user_model().objects.create_user("bob")
    listed = admin_client.get(reverse("admin:api_userlimits_changelist"))
    defaults = UserLimits.load()
    change_url = reverse("admin:api_userlimits_change", args=[defaults.pk])
    assert listed.status_code == 302 and listed.url == change_url
    page = admin_client.get(change_url).content.decode()
    assert 'name="rpm_limit" value="60"' in page
    assert 'name="max_concurrent" value="4"' in page
    assert "overrides-TOTAL_FORMS" in page and "Users with their own limits" in page
    assert admin_client.get(reverse("admin:api_userlimits_add")).status_code == 403
    # Read (and remembered) before the change: the save must not wait 5 s.
    assert user_allowance(user_id=ada.pk).max_concurrent == 4

    defaults.rpm_limit, defaults.max_concurrent = 30, 2
    response = admin_client.post(
        change_url,
        user_limits_form(
            defaults, {"user": ada.pk, "rpm_limit": 0, "max_concurrent": 16}
        ),
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    override = UserLimitOverride.objects.get()
    assert (override.user, override.rpm_limit, override.max_concurrent) == (ada, 0, 16)
    ada_limits, bob_limits = (
        user_allowance(user_id=ada.pk),
        user_allowance(user_id=bob.pk),
    )
    assert (ada_limits.rpm_limit, ada_limits.max_concurrent) == (0, 16)
    assert (bob_limits.rpm_limit, bob_limits.max_concurrent) == (30, 2)
    assert ada.username in admin_client.get(change_url).content.decode()

    saved = {"id": override.pk, "defaults": defaults.pk, "user": ada.pk}
    response = admin_client.post(
        change_url,
        user_limits_form(
            defaults, {**saved, "rpm_limit": 5, "max_concurrent": 1}, initial=1
        ),
    )
    assert response.status_code == 302
    assert user_allowance(user_id=ada.pk).max_concurrent == 1
    response = admin_client.post(
        change_url,
        user_limits_form(
            defaults,
            {**saved, "rpm_limit": 5, "max_concurrent": 1, "DELETE": "on"},
            initial=1,
        ),
    )
    assert response.status_code == 302
    assert not UserLimitOverride.objects.exists()
    assert user_allowance(user_id=ada.pk).max_concurrent == 2


def test_a_user_has_one_override_only(admin_client):
    """Two overrides of the same user are refused by the form (one row per
    user), and nothing is saved."""
    ada = get_user_model().objects.create_user("ada")
    defaults = UserLimits.load()
    response = admin_client.post(
        reverse("admin:api_userlimits_change", args=[defaults.pk]),
        user_limits_form(
            defaults,
            {"user": ada.pk, "rpm_limit": 1, "max_concurrent": 1},
            {"user": ada.pk, "rpm_limit": 2, "max_concurrent": 2},
        ),
    )
    assert response.status_code == 200
    assert "Please correct the duplicate data for user" in response.content.decode()
    assert not UserLimitOverride.objects.exists()
