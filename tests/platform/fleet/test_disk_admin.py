"""The model admin's "Delete files from this host": a confirmation page
listing what would be deleted and its size, the files deleted once
confirmed (in the model's history), a model loaded here refused with the
reason; and the list's column of what each model's files take here."""

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.messages import get_messages
from django.urls import reverse

from catalog.models import ModelConfig
from fleet.models import EngineState
from tests.factories import EngineSpecFactory, ModelConfigFactory

pytestmark = pytest.mark.django_db

MIB = 2**20
CHANGELIST = "admin:catalog_modelconfig_changelist"


@pytest.fixture
def models_dir(tmp_path, settings):
    folder = tmp_path / "models"
    folder.mkdir()
    settings.MODELS_DIR = folder
    settings.RUN_DIR = tmp_path / "run"
    settings.RUN_DIR.mkdir()
    ModelConfig.objects.all().delete()
    return folder


def order(model, **extra) -> dict:
    return {
        "action": "files_delete_here",
        "_selected_action": [model.pk],
        **extra,
    }


def test_the_files_are_listed_then_deleted_once_confirmed(admin_client, models_dir):
    """The first POST only shows the file and its size (nothing deleted);
    the confirmation deletes it, says how much was freed and records it."""
    gguf = models_dir / "org--m" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"\0" * 3 * MIB)
    model = ModelConfigFactory(name="m", path="org--m/m.gguf")
    url = reverse(CHANGELIST)
    page = admin_client.post(url, order(model))
    text = page.content.decode()
    assert page.status_code == 200
    assert str(gguf) in text and "3 MiB" in text
    assert "Yes, I’m sure" in text
    assert gguf.exists()  # control: nothing deleted before the confirmation
    done = admin_client.post(url, order(model, post="yes"), follow=True)
    assert not gguf.exists()
    said = [str(m) for m in get_messages(done.wsgi_request)]
    assert any("m: files deleted from this host, 3 MiB freed" in m for m in said)
    assert LogEntry.objects.filter(
        object_id=str(model.pk), change_message__contains="3 MiB freed"
    ).exists()
    assert ModelConfig.objects.filter(pk=model.pk).exists()  # its row stays


def test_a_model_loaded_here_is_refused_with_the_reason(admin_client, models_dir):
    """Loaded on an engine of this host: an error message naming the engine,
    no confirmation page, and the file kept, even when confirmed."""
    gguf = models_dir / "m.gguf"
    gguf.write_bytes(b"\0" * MIB)
    model = ModelConfigFactory(name="m", path="m.gguf")
    spec = EngineSpecFactory(name="cpu0")
    EngineState.objects.create(
        spec=spec, status="ready", resident_models=[{"name": "m"}]
    )
    url = reverse(CHANGELIST)
    for extra in ({}, {"post": "yes"}):
        answer = admin_client.post(url, order(model, **extra), follow=True)
        said = [str(m) for m in get_messages(answer.wsgi_request)]
        assert "Not deleted: m is loaded on cpu0." in said
        assert "Yes, I’m sure" not in answer.content.decode()
    assert gguf.exists()


def test_the_list_shows_what_each_models_files_take_here(admin_client, models_dir):
    """The column: the size here; "—" for a model whose files are elsewhere."""
    (models_dir / "here.gguf").write_bytes(b"\0" * 2 * MIB)
    ModelConfigFactory(name="here", path="here.gguf")
    ModelConfigFactory(name="away", path="away.gguf")
    text = admin_client.get(reverse(CHANGELIST)).content.decode()
    assert '<td class="field-files_here">2 MiB</td>' in text
    assert '<td class="field-files_here">—</td>' in text
