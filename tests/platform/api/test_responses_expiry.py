"""Stored responses expire: past ROUNDHOUSE_RESPONSES_RETENTION_DAYS they read
as unknown and beat's pass deletes them, in batches, surviving a failed pass;
the admin lists them without what they say. No engine: rows are stored with
the store's own service and read back through the API."""

import logging
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from api.dialects.responses_store import stored_response_save, stored_responses_expire
from api.models import StoredResponse
from api.tasks import expire_stored_responses
from roundhouse.celery import app
from tests.conftest import run_python
from tests.factories import ApiKeyFactory

SECRET_TEXT = "the launch code is 0000"


def stored(key=None, *, user=None, age_days: float = 0, status="completed"):
    """A stored response of `key` (or `user`) stored `age_days` ago."""
    number = StoredResponse.objects.count()
    body = {
        "id": f"resp_{number:04d}",
        "object": "response",
        "model": "model-a",
        "status": status,
        "output": [{"type": "message", "content": [{"text": SECRET_TEXT}]}],
    }
    row = stored_response_save(
        key=key,
        user=user,
        body=body,
        input_items=[{"type": "message", "content": SECRET_TEXT}],
        conversation=[{"role": "assistant", "content": SECRET_TEXT}],
    )
    StoredResponse.objects.filter(pk=row.pk).update(
        created_at=timezone.now() - timedelta(days=age_days)
    )
    return row


def kept_ids() -> set[str]:
    return set(StoredResponse.objects.values_list("id", flat=True))


@pytest.mark.django_db
def test_the_pass_deletes_only_expired_stored_responses(settings):
    """Kept 30 days: the pass deletes a 31-day-old response and keeps one
    stored a day earlier than that limit and one just stored (the control:
    the check would see a pass that deleted everything)."""
    settings.ROUNDHOUSE_RESPONSES_RETENTION_DAYS = 30
    key = ApiKeyFactory()
    old = stored(key, age_days=31)
    recent = stored(key, age_days=29)
    fresh = stored(key)
    assert expire_stored_responses() == 1
    assert kept_ids() == {recent.id, fresh.id}
    assert old.id not in kept_ids()


@pytest.mark.django_db
def test_the_pass_deletes_in_batches_until_none_is_left(settings):
    """More expired rows than a batch: every one is deleted in one pass,
    a batch at a time; the fresh one stays."""
    settings.ROUNDHOUSE_RESPONSES_RETENTION_DAYS = 1
    key = ApiKeyFactory()
    for _ in range(5):
        stored(key, age_days=2)
    fresh = stored(key)
    assert stored_responses_expire(batch=2) == 5
    assert kept_ids() == {fresh.id}


@pytest.mark.django_db
def test_retention_zero_keeps_stored_responses_until_deleted(settings):
    """0 days: nothing expires, however old, and an old response still reads
    back."""
    settings.ROUNDHOUSE_RESPONSES_RETENTION_DAYS = 0
    key = ApiKeyFactory()
    old = stored(key, age_days=3650)
    assert expire_stored_responses() == 0
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key.plaintext}")
    assert client.get(f"/v1/responses/{old.id}").status_code == 200


@pytest.mark.django_db
def test_an_expired_response_is_not_found_as_an_unknown_id(settings):
    """An expired response answers as an unknown id does (404,
    response_not_found), before the pass (it reads as gone at once) and after
    it (its row deleted); its input items too. The control: a fresh response
    of the same key reads back."""
    settings.ROUNDHOUSE_RESPONSES_RETENTION_DAYS = 30
    key = ApiKeyFactory()
    old = stored(key, age_days=31)
    fresh = stored(key)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key.plaintext}")
    unknown = client.get("/v1/responses/resp_unknown")
    assert unknown.status_code == 404
    code = unknown.json()["error"]["code"]
    assert code == "response_not_found"

    before = client.get(f"/v1/responses/{old.id}")
    assert (before.status_code, before.json()["error"]["code"]) == (404, code)
    expire_stored_responses()
    assert not StoredResponse.objects.filter(id=old.id).exists()
    for path in (f"/v1/responses/{old.id}", f"/v1/responses/{old.id}/input_items"):
        after = client.get(path)
        assert (after.status_code, after.json()["error"]["code"]) == (404, code)
    assert client.get(f"/v1/responses/{fresh.id}").json()["id"] == fresh.id


def test_a_failed_pass_is_logged_and_the_next_one_deletes(outage, settings, caplog):
    """With the database gone, the task logs the failure and returns (beat
    goes on); once it is back, the next pass deletes what expired."""
    settings.ROUNDHOUSE_RESPONSES_RETENTION_DAYS = 30
    old = stored(ApiKeyFactory(), age_days=31)
    outage.start()
    with caplog.at_level(logging.ERROR, logger="api.tasks"):
        assert expire_stored_responses() == 0
    [failure] = [r for r in caplog.records if r.name == "api.tasks"]
    assert failure.exc_info is not None
    outage.end()
    assert expire_stored_responses() == 1
    assert old.id not in kept_ids()


def test_a_negative_retention_is_refused_at_start():
    """ROUNDHOUSE_RESPONSES_RETENTION_DAYS below 0 stops Django's start,
    naming the variable; 0 starts (the control)."""
    start = "import django; django.setup()"
    env = {"DJANGO_SETTINGS_MODULE": "roundhouse.settings"}
    refused = run_python(
        start, env={**env, "ROUNDHOUSE_RESPONSES_RETENTION_DAYS": "-1"}
    )
    assert refused.returncode != 0
    assert "ROUNDHOUSE_RESPONSES_RETENTION_DAYS must be" in refused.stderr
    started = run_python(start, env={**env, "ROUNDHOUSE_RESPONSES_RETENTION_DAYS": "0"})
    assert started.returncode == 0, started.stderr


def test_beat_runs_the_pass():
    """CELERY_BEAT_SCHEDULE names the pass, by a name the Celery app knows
    (a misspelt name would be an entry beat sends and no worker runs)."""
    [entry] = [
        entry
        for entry in django_settings.CELERY_BEAT_SCHEDULE.values()
        if entry["task"] == "api.expire_stored_responses"
    ]
    assert entry["schedule"] > 0
    app.loader.import_default_modules()
    assert app.tasks[entry["task"]].run is expire_stored_responses.run
    assert "api.no_such_task" not in app.tasks


@pytest.mark.django_db
def test_the_admin_lists_stored_responses_without_what_they_say(
    admin_client, django_user_model
):
    """The list shows each response's id, owner (key or user), model, status,
    stored and expiry; neither it nor a response's page shows what was said
    (the control: the row holds it). No add, no change; delete works."""
    key = ApiKeyFactory(name="reader")
    user = django_user_model.objects.create_user("ada")
    by_key = stored(key, status="incomplete")
    by_user = stored(user=user)
    assert SECRET_TEXT in str(StoredResponse.objects.get(pk=by_key.pk).body)

    listing = admin_client.get(reverse("admin:api_storedresponse_changelist"))
    page = listing.content.decode()
    assert listing.status_code == 200
    for shown in (by_key.id, by_user.id, "reader", "ada", "model-a", "incomplete"):
        assert shown in page
    assert SECRET_TEXT not in page
    assert key.key_hash not in page
    one = admin_client.get(reverse("admin:api_storedresponse_change", args=[by_key.pk]))
    assert one.status_code == 200
    assert SECRET_TEXT not in one.content.decode()
    assert key.plaintext not in one.content.decode()

    add = admin_client.get(reverse("admin:api_storedresponse_add"))
    assert add.status_code == 403
    delete = reverse("admin:api_storedresponse_delete", args=[by_key.pk])
    admin_client.post(delete, {"post": "yes"})
    assert kept_ids() == {by_user.id}
