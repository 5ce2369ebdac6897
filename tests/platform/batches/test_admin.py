"""The batches' admin: progress as lines are answered, and the cancel action."""

import pytest
from django.urls import reverse

from batches import services
from batches.models import Batch

pytestmark = pytest.mark.django_db


def test_the_list_shows_progress(admin_client, batch):
    url = reverse("admin:batches_batch_changelist")
    assert "reading the file" in admin_client.get(url).content.decode()
    owner = "w:1:1:a"
    services.batch_claim(batch_id=batch.id, owner=owner)
    services.batch_start(batch=batch, total=1000)
    answers = [(n, f"c{n}", n % 100 != 0, {}) for n in range(412)]
    services.batch_record(batch_id=batch.id, owner=owner, answers=answers)
    assert "412 / 1,000 (41%), 5 failed" in admin_client.get(url).content.decode()


def test_the_cancel_action_asks_open_batches_to_stop(admin_client, batch):
    done = Batch.objects.create(
        id="batch_done",
        key=batch.key,
        endpoint=batch.endpoint,
        input_file=batch.input_file,
        status="completed",
        expires_at=batch.expires_at,
    )
    response = admin_client.post(
        reverse("admin:batches_batch_changelist"),
        {"action": "cancel_batches", "_selected_action": [batch.id, done.id]},
        follow=True,
    )
    assert "Asked 1 batch(es) to stop" in response.content.decode()
    batch.refresh_from_db()
    done.refresh_from_db()
    assert batch.status == "cancelling" and batch.cancelling_at is not None
    assert done.status == "completed"
