"""The admin's actions check the permission to change what they change: a
staff member who may only view gets the admin's refusal (the action is
neither offered nor run) and nothing changes; one with the change permission
is obeyed (the control). The dashboard's orders: tests/platform/chat/
test_dashboard_views.py."""

import pytest
from django.test import Client
from django.urls import reverse

from batches.models import Batch
from tests.factories import EngineSpecFactory, ModelConfigFactory
from tests.platform.staff import CHANGE, VIEW, staff_member

pytestmark = pytest.mark.django_db


def staff_client(name: str, permissions: list[str]) -> Client:
    """A client logged in as a new staff member holding `permissions`."""
    client = Client()
    client.force_login(staff_member(name, permissions))
    return client


@pytest.fixture
def viewer() -> Client:
    return staff_client("viewer", VIEW)


@pytest.fixture
def operator() -> Client:
    return staff_client("operator", [*VIEW, *CHANGE])


def act(client: Client, changelist: str, action: str, rows, **more):
    return client.post(
        reverse(changelist),
        {"action": action, "_selected_action": [row.pk for row in rows], **more},
        follow=True,
    )


def test_model_actions_need_the_change_permission(
    viewer, operator, django_capture_on_commit_callbacks
):
    """Measure memory, inspect again and requantize: a viewer's are not run
    (no job marked, nothing queued, no variant), and the list offers none of
    them; an operator's are."""
    model = ModelConfigFactory(name="smol")
    changelist = "admin:catalog_modelconfig_changelist"
    assert "measure_memory" not in viewer.get(reverse(changelist)).content.decode()
    with django_capture_on_commit_callbacks() as queued:
        act(viewer, changelist, "measure_memory", [model])
        act(viewer, changelist, "inspect_again", [model])
        act(viewer, changelist, "requantize", [model], quantization="Q8_0", apply=1)
    model.refresh_from_db()
    assert (model.memory_job, queued) == ("", [])
    assert not model.variants.exists()

    assert "measure_memory" in operator.get(reverse(changelist)).content.decode()
    with django_capture_on_commit_callbacks() as queued:
        act(operator, changelist, "measure_memory", [model])
        act(operator, changelist, "inspect_again", [model])
        act(operator, changelist, "requantize", [model], quantization="Q8_0", apply=1)
    model.refresh_from_db()
    assert model.memory_job == "queued" and len(queued) == 3
    assert model.variants.get().quantized_to == "Q8_0"


def test_requantizing_needs_the_add_permission_too():
    """Requantizing adds a model: the change permission alone does not do."""
    model = ModelConfigFactory(name="smol")
    editor = staff_client("editor", ["catalog.change_modelconfig"])
    act(
        editor,
        "admin:catalog_modelconfig_changelist",
        "requantize",
        [model],
        quantization="Q8_0",
        apply=1,
    )
    assert not model.variants.exists()


def test_cancelling_a_batch_needs_the_change_permission(viewer, operator, batch):
    """A viewer's cancel leaves the batch running; an operator's stops it."""
    changelist = "admin:batches_batch_changelist"
    act(viewer, changelist, "cancel_batches", [batch])
    batch.refresh_from_db()
    assert batch.status not in ("cancelling", "cancelled")
    response = act(operator, changelist, "cancel_batches", [batch])
    assert "Asked 1 batch(es) to stop" in response.content.decode()
    assert Batch.objects.get(pk=batch.pk).status == "cancelling"


def test_restarting_an_engine_in_the_admin_needs_the_change_permission(
    viewer, operator
):
    spec = EngineSpecFactory(name="cpu9")
    changelist = "admin:fleet_enginespec_changelist"
    act(viewer, changelist, "restart_engines", [spec])
    spec.refresh_from_db()
    assert spec.restart_requested_at is None
    act(operator, changelist, "restart_engines", [spec])
    spec.refresh_from_db()
    assert spec.restart_requested_at is not None
