"""Catalog -> Models -> Add from Hugging Face (fleet/hub_admin.py) against the
local hub (tests/hub.py) through HF_ENDPOINT: the repository's files and its
quantizations with what each needs and where it fits, read from the header
alone; a Hub refusal shown as a message; the page for those who may add
models only; its Pull button starting the job. And the pulls' admin
(catalog/admin.py ModelPullAdmin): progress, its JSON, cancel."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from catalog.models import ModelPull, PullStatus
from catalog.pull_jobs import pull_run
from cluster.models import Node
from fleet.models import EngineSpec
from tests.factories import EngineSpecFactory, ModelConfigFactory
from tests.hub import LocalHub
from tests.platform.staff import staff_member

pytestmark = pytest.mark.django_db

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "org/SmolLM2-135M-GGUF"
FILE = "smol.Q4_1.gguf"
PAGE = "/admin/catalog/modelconfig/add-from-hub/"
HEADER_ONLY = 4 << 20


@pytest.fixture
def hub(monkeypatch, settings, tmp_path):
    smol = Path(settings.MODELS_DIR) / SMOL
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    files = {
        FILE: smol,
        "mmproj-smol-f16.gguf": b"GGUF" + bytes(60),
        "README.md": b"hi\n",
    }
    with LocalHub({REPO: files}) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


@pytest.fixture
def cards(tmp_path, settings):
    """Two GPU engines on this host: one card with 50 MiB free, one with 8 GiB
    (the engines' device probe reads the file)."""
    path = tmp_path / "cards.json"
    path.write_text(
        json.dumps(
            {
                "gpus": [
                    {"id": "GPU-small", "total_mib": 4096, "used_mib": 4046},
                    {"id": "GPU-big", "total_mib": 8192, "used_mib": 0},
                ]
            }
        )
    )
    settings.ROUNDHOUSE_DEVICE_MEMORY_FILE = str(path)
    EngineSpec.objects.update(enabled=False)  # the seeded cpu0: this host's RAM
    EngineSpecFactory(name="gpu-small", backend="cuda", devices="GPU-small")
    return path


def messages_of(response) -> list[str]:
    return [m.message for m in get_messages(response.wsgi_request)]


def test_quantizations_are_listed_with_their_fit_before_the_weights(
    admin_client, hub, cards
):
    """Its files with sizes; its quantization with its need and fit, read
    from the header (under 4 MiB of a file of ~90 MiB); the projector named.
    Control: the card with room is said to fit once its engine exists."""
    page = admin_client.get(PAGE, {"repo": REPO, "revision": "main"})
    assert page.status_code == 200
    text = page.content.decode()
    assert f"{REPO} at commit <code>{hub.commit_sha(REPO)[:12]}</code>" in text
    assert "README.md" in text and "mmproj-smol-f16.gguf" in text
    assert "Q4_1" in text and "llama, chat, trained context 8192" in text
    assert "fits nowhere: needs " in text
    assert "the largest free is 50 MiB on gpu-small" in text
    assert 'value="smollm2-135m:q4_1"' in text  # the name, prefilled
    assert "vision projector, <code>mmproj-smol-f16.gguf</code>" in text
    assert 0 < hub.bytes_served(REPO, FILE) < HEADER_ONLY

    EngineSpecFactory(name="gpu-big", backend="cuda", devices="GPU-big")
    text = admin_client.get(PAGE, {"repo": REPO}).content.decode()
    assert "fits on gpu-big, " in text and "fits nowhere" not in text


def test_an_unknown_repository_is_a_message_not_an_error(admin_client, hub):
    """Control: a known one lists its files."""
    page = admin_client.get(PAGE, {"repo": "org/nothing", "revision": "main"})
    assert page.status_code == 200
    assert messages_of(page) == ["no repository org/nothing on the Hub"]
    assert "All its files" not in page.content.decode()
    known = admin_client.get(PAGE, {"repo": REPO, "revision": "main"})
    assert "All its files" in known.content.decode()


def test_an_unknown_revision_and_a_bad_name_say_what_to_give(admin_client, hub):
    page = admin_client.get(PAGE, {"repo": REPO, "revision": "nope"})
    assert messages_of(page) == [f"{REPO} has no revision nope"]
    page = admin_client.get(PAGE, {"repo": "not a repo"})
    assert "Give it as ORG/REPO" in page.content.decode()


def test_only_staff_who_may_add_models_get_the_page(client, hub):
    """A staff member who may only view models is refused and offered no
    button; one who may add them gets both."""
    viewer = staff_member("viewer", ["catalog.view_modelconfig"])
    client.force_login(viewer)
    assert client.get(PAGE).status_code == 403
    listing = client.get("/admin/catalog/modelconfig/").content.decode()
    assert "Add from Hugging Face" not in listing
    adder = staff_member(
        "adder", ["catalog.view_modelconfig", "catalog.add_modelconfig"]
    )
    client.force_login(adder)
    assert client.get(PAGE).status_code == 200
    listing = client.get("/admin/catalog/modelconfig/").content.decode()
    assert f'href="{PAGE}"' in listing and "Add from Hugging Face" in listing


class Listing(BaseHTTPRequestHandler):
    """The Hub's model search (GET /api/models), which the local hub does
    not serve: two repositories, and the queries it was sent."""

    queries: list[dict] = []

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        found = [
            {"id": "org/smol-GGUF", "downloads": 1200},
            {"id": "org/other", "downloads": 3},
        ]
        body = json.dumps(found if url.path == "/api/models" else {}).encode()
        Listing.queries.append(parse_qs(url.query))
        self.send_response(200 if url.path == "/api/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def listing(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Listing)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    Listing.queries = []
    yield Listing
    server.shutdown()
    server.server_close()


def test_the_search_box_finds_repositories_by_name(admin_client, listing):
    """GGUF ones only, the most downloaded first, each a link to its files;
    unticked, without the GGUF filter."""
    page = admin_client.get(PAGE, {"q": "smol", "gguf": "on"})
    text = page.content.decode()
    assert '<a href="?repo=org%2Fsmol-GGUF&amp;revision=main">org/smol-GGUF</a>' in text
    [query] = listing.queries
    assert query["search"] == ["smol"] and query["filter"] == ["gguf"]
    assert query["sort"] == ["downloads"]
    admin_client.get(PAGE, {"q": "smol"})
    assert "filter" not in listing.queries[-1]


def test_a_failed_search_is_a_message(admin_client, hub):
    """The local hub serves no search: its 404 is a message on the page."""
    page = admin_client.get(PAGE, {"q": "smol", "gguf": "on"})
    assert page.status_code == 200
    [message] = messages_of(page)
    assert message.startswith("the Hub failed: ")


def pull_form(**fields) -> dict:
    return {
        "repo": REPO,
        "file": FILE,
        "commit": "main",
        "name": "smol-pulled",
        **fields,
    }


@pytest.mark.django_db(transaction=True)
def test_pull_starts_the_job_and_opens_its_page(admin_client, hub, settings):
    """The Pull button queues the pull (the plan read, no weights) and opens
    its page; run, the page links the model. Control for the header-only
    read: the run fetches the whole file. (Committed rows: the run's
    progress is written by a thread of its own, on its own connection.)"""
    commit = hub.commit_sha(REPO)
    answer = admin_client.post(PAGE, pull_form(commit=commit))
    pull = ModelPull.objects.get(name="smol-pulled")
    assert answer.status_code == 302
    assert answer.url == reverse("admin:catalog_modelpull_change", args=[pull.pk])
    assert (pull.status, pull.source, pull.revision) == (
        PullStatus.QUEUED,
        f"hf:{REPO}/{FILE}",
        commit,
    )
    assert pull.plan["files"][1]["name"] == "mmproj-smol-f16.gguf"
    assert hub.bytes_served(REPO, FILE) < HEADER_ONLY
    page = admin_client.get(answer.url).content.decode()
    assert 'id="pull-bar"' in page and "Cancel the pull" in page
    assert "catalog/pull_progress.js" in page

    assert pull_run(pull.pk) == PullStatus.DONE
    assert hub.bytes_served(REPO, FILE) > hub.blob(REPO, FILE).size
    pull.refresh_from_db()
    page = admin_client.get(answer.url).content.decode()
    model_url = reverse("admin:catalog_modelconfig_change", args=[pull.model_id])
    assert f'<a href="{model_url}">smol-pulled</a>' in page
    assert "Cancel the pull" not in page
    progress = admin_client.get(
        reverse("admin:catalog_modelpull_progress", args=[pull.pk])
    ).json()
    assert progress["status"] == "done" and progress["model_url"] == model_url
    assert progress["done_bytes"] == progress["size_bytes"] == pull.size_bytes


def test_a_refused_pull_is_a_message(admin_client, hub):
    """A taken name or one the catalog refuses: no pull, back with the
    reason (control: a free name starts one)."""
    ModelConfigFactory(name="taken")
    answer = admin_client.post(PAGE, pull_form(name="taken"), follow=True)
    assert not ModelPull.objects.exists()
    assert any("a model named taken exists" in m for m in messages_of(answer))
    assert "All its files" in answer.content.decode()
    answer = admin_client.post(PAGE, pull_form(name="no spaces!"), follow=True)
    assert not ModelPull.objects.exists()
    [message] = messages_of(answer)
    assert message.startswith("The pull was not started: name: Use letters")
    admin_client.post(PAGE, pull_form(name="free"))
    assert ModelPull.objects.filter(name="free").exists()


def test_nodes_are_offered_and_the_pull_goes_to_the_one_chosen(admin_client, hub):
    Node.objects.create(name="b", address="10.0.0.2")
    page = admin_client.get(PAGE, {"repo": REPO}).content.decode()
    assert '<option value="b">node b</option>' in page
    admin_client.post(PAGE, pull_form(node="b"))
    assert ModelPull.objects.get(name="smol-pulled").node == "b"


def a_pull(**fields) -> ModelPull:
    return ModelPull.objects.create(
        source=f"hf:{REPO}",
        name=fields.pop("name", "smol"),
        size_bytes=200 << 20,
        **fields,
    )


def test_the_list_shows_progress_rate_and_time_left(admin_client):
    a_pull(
        status=PullStatus.RUNNING,
        done_bytes=80 << 20,
        rate_bps=10 << 20,
        left_s=12.0,
    )
    text = admin_client.get("/admin/catalog/modelpull/").content.decode()
    assert "40.0%" in text and "10.0 MiB/s" in text and "12 s" in text


def test_cancel_ends_an_open_pull_for_those_who_may_change_it(admin_client, client):
    """A viewer sees no button and is refused (the pull stays queued); a
    change permission holder cancels it."""
    pull = a_pull()
    cancel = reverse("admin:catalog_modelpull_cancel", args=[pull.pk])
    change = reverse("admin:catalog_modelpull_change", args=[pull.pk])
    client.force_login(staff_member("watcher", ["catalog.view_modelpull"]))
    assert "Cancel the pull" not in client.get(change).content.decode()
    assert client.post(cancel).status_code == 403
    pull.refresh_from_db()
    assert pull.status == PullStatus.QUEUED
    assert admin_client.get(cancel).status_code == 405  # a POST only

    answer = admin_client.post(cancel)
    assert answer.status_code == 302 and answer.url == change
    pull.refresh_from_db()
    assert pull.status == PullStatus.CANCELLED


def test_the_cancel_action_asks_running_pulls_to_stop(admin_client):
    running = a_pull(status=PullStatus.RUNNING, lease_owner="w1", name="one")
    done = a_pull(status=PullStatus.DONE, name="two")
    admin_client.post(
        "/admin/catalog/modelpull/",
        {"action": "cancel_pulls", "_selected_action": [running.pk, done.pk]},
    )
    running.refresh_from_db()
    done.refresh_from_db()
    assert running.cancel_requested and running.status == PullStatus.RUNNING
    assert not done.cancel_requested and done.status == PullStatus.DONE


def test_progress_json_needs_the_view_permission(client):
    pull = a_pull(status=PullStatus.RUNNING, done_bytes=50 << 20)
    url = reverse("admin:catalog_modelpull_progress", args=[pull.pk])
    client.force_login(staff_member("stranger", ["catalog.view_modelconfig"]))
    assert client.get(url).status_code == 403
    client.force_login(staff_member("watcher", ["catalog.view_modelpull"]))
    progress = client.get(url).json()
    assert progress["percent"] == "25.0%" and progress["open"]


MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture
def folder_hub(monkeypatch, settings, tmp_path):
    """The bundled MiniLM as a sentence-transformers repository."""
    bundled = Path(settings.MODELS_DIR) / "all-MiniLM-L6-v2"
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    files = {
        str(path.relative_to(bundled)): path
        for path in sorted(bundled.rglob("*"))
        if path.is_file()
    }
    with LocalHub({MINILM: files}) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


def test_a_transformers_repository_is_offered_as_a_folder(admin_client, folder_hub):
    """No GGUF file: the model it is, its parameters and need from its small
    files and the safetensors header (not the weights), its fit on the
    engines serving embeddings, and a Pull that takes the whole folder."""
    text = admin_client.get(PAGE, {"repo": MINILM}).content.decode()
    assert 'id="hub-folder"' in text
    assert "embedding, embedding, bert, trained context 512" in text
    assert "M F32" in text and "fits on cpu0, " in text
    assert folder_hub.bytes_served(MINILM, "model.safetensors") <= 100_001
    assert 'value="all-minilm-l6-v2"' in text

    answer = admin_client.post(
        PAGE,
        {
            "repo": MINILM,
            "file": "",
            "commit": folder_hub.commit_sha(MINILM),
            "name": "minilm",
        },
    )
    pull = ModelPull.objects.get(name="minilm")
    assert answer.url == reverse("admin:catalog_modelpull_change", args=[pull.pk])
    assert pull.source == f"hf:{MINILM}"
    assert pull.plan["format"] == "embedding"
