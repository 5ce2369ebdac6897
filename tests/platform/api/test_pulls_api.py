"""Managing models over the API (api.pulls) through the front's ASGI handler,
against the local hub (tests/hub.py) serving the bundled SmolLM2 GGUF, found
through HF_ENDPOINT as a mirror would be: a pull started with a key that
manages models is answered 202 and, run by catalog.pull_jobs.pull_run as a
worker runs it, followed over its event stream to "done" with the model's
name; the Hub's refusals come back as the API's errors before anything is
queued; a pull held mid-file is cancelled; a model is deleted unless it is
loaded or placed. A pull the Hub holds reads stalled; on a cluster, one that
names no node runs where its first replica would be placed. Every other key
gets 403."""

import asyncio
import json
from pathlib import Path

import httpx2 as httpx
import jsonschema_rs
import openai
import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.urls import reverse
from django.utils import timezone
from huggingface_hub import constants as hf_constants

from api import bodies, errors, openapi
from api.models import ApiKey
from catalog.models import ModelConfig, ModelPull, PullStatus
from catalog.pull import STAGING
from catalog.pull_jobs import pull_run
from cluster.models import Node
from fleet.models import EngineSpec, EngineState
from tests.factories import ApiKeyFactory, EngineSpecFactory, ModelConfigFactory
from tests.hub import LocalHub
from tests.waiting import await_for

pytestmark = pytest.mark.django_db(transaction=True)

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "org/SmolLM2-135M-GGUF"
FILE = "smol.Q4_1.gguf"
SOURCE = f"hf:{REPO}:Q4_1"
FINISHED = {"done", "failed", "cancelled"}


@pytest.fixture
def hub(monkeypatch, settings, tmp_path):
    """The local hub with the bundled SmolLM2 GGUF, HF_ENDPOINT pointed at
    it, and a models directory of the test's own."""
    smol = Path(settings.MODELS_DIR) / SMOL
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub({REPO: {FILE: smol, "README.md": b"hi\n"}}) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


@pytest.fixture
def app():
    from roundhouse.asgi import api_application

    return api_application


def key_of(*, manages_models: bool) -> str:
    return ApiKeyFactory(manages_models=manages_models).plaintext


@pytest.fixture
async def manager(app):
    """An httpx client of the front with a key that manages models."""
    key = await sync_to_async(key_of)(manages_models=True)
    async with client_of(app, key) as client:
        yield client


def client_of(app, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("10.0.0.9", 40000)),
        base_url="http://127.0.0.1",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def events(body: bytes) -> list[dict]:
    """The JSON events of a Server-Sent Events body (comments left out)."""
    return [
        json.loads(line.removeprefix(b"data: "))
        for line in body.splitlines()
        if line.startswith(b"data: ")
    ]


def fits(body: type[bodies.Body], answer: dict) -> None:
    """The answer is the body's, key for key, and fits the document's schema."""
    assert body.model_validate(answer).model_dump(mode="json") == answer
    jsonschema_rs.Draft202012Validator(
        {
            "$ref": f"#/components/schemas/{body.__name__}",
            "components": openapi.openapi_document()["components"],
        }
    ).validate(answer)


def refusal(response: httpx.Response, status: int, code: str) -> str:
    """The error's message, once its status, shape and code are checked."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error["message"]


async def run_pull(pull_id: int) -> str:
    """Run the pull as a worker would (its task's body), in a thread, which
    closes its database connection when done."""

    def run() -> str:
        try:
            return pull_run(pull_id)
        finally:
            connections.close_all()

    return await asyncio.to_thread(run)


# -- a pull, start to end -----------------------------------------------------------


async def test_a_pull_is_started_and_followed_to_done(hub, manager):
    """202 with the queued pull; its event stream says each change, ends
    after "done", and the last event names the model, which is in the
    catalog with its file in place."""
    response = await manager.post("/v1/pulls", json={"source": SOURCE})
    assert response.status_code == 202, response.text
    started = response.json()
    assert started["object"] == "model.pull"
    assert (started["status"], started["model"]) == ("queued", None)
    assert started["name"] == "smollm2-135m:q4_1"
    assert started["size_bytes"] == hub.blob(REPO, FILE).size

    stream = asyncio.create_task(manager.get(f"/v1/pulls/{started['id']}/events"))
    assert await run_pull(started["id"]) == PullStatus.DONE
    followed = await asyncio.wait_for(stream, 60)
    assert followed.status_code == 200
    assert followed.headers["content-type"] == "text/event-stream"
    seen = events(followed.content)
    # The stream may start before the worker or after it took the pull.
    assert seen[0]["status"] in ("queued", "running")
    assert seen[-1]["status"] == "done"
    assert [e for e in seen[:-1] if e["status"] in FINISHED] == []
    assert seen[-1]["model"] == "smollm2-135m:q4_1"
    assert seen[-1]["done_bytes"] == seen[-1]["size_bytes"]
    assert seen[-1]["finished_at"] >= seen[-1]["created_at"]
    for event in [started, *seen]:
        fits(bodies.ModelPull, event)
    model = await ModelConfig.objects.aget(name="smollm2-135m:q4_1")
    assert (Path(settings.MODELS_DIR) / model.path).stat().st_size == hub.blob(
        REPO, FILE
    ).size

    # It reads the same afterwards, alone and in the list.
    again = (await manager.get(f"/v1/pulls/{started['id']}")).json()
    assert again == seen[-1]
    listed = (await manager.get("/v1/pulls")).json()
    assert [pull["id"] for pull in listed["data"]] == [started["id"]]
    assert listed["has_more"] is False
    fits(bodies.ModelPullList, listed)


async def test_the_list_is_newest_first_a_page_at_a_time(manager):
    """Pulls newest first; `after` the page's last id gives the next."""
    ids = []
    for n in range(3):
        pull = await ModelPull.objects.acreate(source=SOURCE, name=f"m{n}")
        ids.append(pull.pk)
    first = (await manager.get("/v1/pulls?limit=2")).json()
    assert [p["id"] for p in first["data"]] == [ids[2], ids[1]]
    assert first["has_more"] is True and first["last_id"] == ids[1]
    rest = (await manager.get(f"/v1/pulls?limit=2&after={ids[1]}")).json()
    assert [p["id"] for p in rest["data"]] == [ids[0]]
    assert rest["has_more"] is False
    refusal(await manager.get("/v1/pulls?limit=0"), 400, None)


# -- who may ------------------------------------------------------------------------


async def test_an_ordinary_key_gets_403_and_a_managing_key_202(hub, app):
    """Control: the same request with a key that manages models is 202."""
    ordinary = await sync_to_async(key_of)(manages_models=False)
    async with client_of(app, ordinary) as client:
        for method, path in [
            ("POST", "/v1/pulls"),
            ("GET", "/v1/pulls"),
            ("GET", "/v1/pulls/1"),
            ("DELETE", "/v1/pulls/1"),
            ("GET", "/v1/pulls/1/events"),
            ("DELETE", "/v1/models/anything"),
        ]:
            body = {"source": SOURCE} if method == "POST" else None
            response = await client.request(method, path, json=body)
            refusal(response, 403, errors.ApiCode.MODELS_NOT_MANAGED)
    assert await ModelPull.objects.acount() == 0
    # The official client reads the refusal as its own exception.
    sdk = openai.AsyncOpenAI(
        base_url="http://127.0.0.1/v1",
        api_key=ordinary,
        http_client=client_of(app, ordinary),
        max_retries=0,
    )
    with pytest.raises(openai.PermissionDeniedError):
        await sdk.post("/pulls", body={"source": SOURCE}, cast_to=object)

    managing = await sync_to_async(key_of)(manages_models=True)
    async with client_of(app, managing) as client:
        response = await client.post("/v1/pulls", json={"source": SOURCE})
    assert response.status_code == 202, response.text


async def test_a_missing_or_bad_key_gets_401(hub, app):
    async with client_of(app, "rh-not-a-key") as client:
        refusal(await client.get("/v1/pulls"), 401, errors.ApiCode.INVALID_API_KEY)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as client:
        refusal(await client.get("/v1/pulls"), 401, errors.ApiCode.INVALID_API_KEY)


# -- the Hub's refusals, before anything is queued -----------------------------------


async def test_a_bad_source_is_400(hub, manager):
    message = refusal(
        await manager.post("/v1/pulls", json={"source": "ollama:smol"}),
        400,
        errors.ApiCode.SOURCE_INVALID,
    )
    assert "is not hf:ORG/REPO" in message
    # The body's own schema: unknown keys, bad names.
    response = await manager.post("/v1/pulls", json={"source": SOURCE, "x": 1})
    assert response.status_code == 400
    assert "Unrecognized request argument supplied: x" in response.text
    response = await manager.post("/v1/pulls", json={"source": SOURCE, "name": "-x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "name"
    response = await manager.post("/v1/pulls", json={"source": SOURCE, "node": "nope"})
    assert "No node is named 'nope'" in refusal(response, 400, None)
    assert await ModelPull.objects.acount() == 0


async def test_a_body_over_the_cap_is_refused_unread(settings, manager):
    """413 from its Content-Length, as every API body (roundhouse.asgi);
    control: the same body under the cap reaches the schema (400 for the
    unknown key)."""
    body = {"source": SOURCE, "padding": "x" * 2000}
    settings.ROUNDHOUSE_MAX_REQUEST_BYTES = 1000
    refusal(
        await manager.post("/v1/pulls", json=body),
        413,
        errors.ApiCode.REQUEST_TOO_LARGE,
    )
    settings.ROUNDHOUSE_MAX_REQUEST_BYTES = 100_000
    response = await manager.post("/v1/pulls", json=body)
    assert response.json()["error"]["param"] == "padding"


async def test_a_gated_repository_without_a_token_is_401(
    monkeypatch, settings, manager
):
    """The hub's gated repository, no token on this host: 401 naming the
    variable to set, nothing queued."""
    smol = Path(settings.MODELS_DIR) / SMOL
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub({REPO: {FILE: smol}}, gated={REPO}) as gated:
        monkeypatch.setenv("HF_ENDPOINT", gated.url)
        message = refusal(
            await manager.post("/v1/pulls", json={"source": SOURCE}),
            401,
            errors.ApiCode.SOURCE_GATED,
        )
    assert "HF_TOKEN" in message
    assert await ModelPull.objects.acount() == 0


async def test_an_unknown_repository_is_404(hub, manager):
    """Control: the repository the hub has is found (202)."""
    refusal(
        await manager.post("/v1/pulls", json={"source": "hf:org/no-such-repo"}),
        404,
        errors.ApiCode.SOURCE_NOT_FOUND,
    )
    assert await ModelPull.objects.acount() == 0
    response = await manager.post("/v1/pulls", json={"source": f"hf:{REPO}"})
    assert response.status_code == 202


async def test_a_name_taken_is_409_before_a_byte(hub, manager):
    """Control: the same pull under a free name is 202."""
    await sync_to_async(ModelConfigFactory)(name="taken")
    message = refusal(
        await manager.post("/v1/pulls", json={"source": SOURCE, "name": "taken"}),
        409,
        errors.ApiCode.MODEL_NAME_TAKEN,
    )
    assert "a model named taken exists" in message
    assert hub.bytes_served(REPO, FILE) < 4 << 20  # the header only
    response = await manager.post("/v1/pulls", json={"source": SOURCE, "name": "free"})
    assert response.status_code == 202


async def test_an_unknown_pull_is_404(manager):
    for path in ("/v1/pulls/999", "/v1/pulls/abc", "/v1/pulls/999/events"):
        refusal(await manager.get(path), 404, errors.ApiCode.PULL_NOT_FOUND)
    refusal(await manager.delete("/v1/pulls/999"), 404, errors.ApiCode.PULL_NOT_FOUND)


# -- cancel, and a caller that hangs up ----------------------------------------------


async def test_a_pull_held_mid_file_is_cancelled(hub, manager):
    """DELETE while the Hub holds the transfer mid-file: the pull stops at
    its next progress write, cancelled, its partial file gone, no model."""
    started = (await manager.post("/v1/pulls", json={"source": SOURCE})).json()
    stall = hub.stall(REPO, FILE)
    running = asyncio.create_task(run_pull(started["id"]))
    try:
        assert await asyncio.to_thread(stall.reached.wait, 60), "never stalled"
        stream = asyncio.create_task(manager.get(f"/v1/pulls/{started['id']}/events"))
        cancelled = await manager.delete(f"/v1/pulls/{started['id']}")
        assert cancelled.status_code == 200
        assert cancelled.json()["status"] in ("running", "cancelled")
    finally:
        stall.release.set()
    assert await asyncio.wait_for(running, 60) == PullStatus.CANCELLED
    seen = events((await asyncio.wait_for(stream, 60)).content)
    assert seen[-1]["status"] == "cancelled" and seen[-1]["model"] is None
    assert not await ModelConfig.objects.filter(name=started["name"]).aexists()
    staging = Path(settings.MODELS_DIR) / STAGING
    assert not [p for p in staging.rglob("*") if p.is_file()]


async def test_a_pull_the_hub_holds_reads_stalled(hub, manager, monkeypatch):
    """Held mid-file (the client's read deadline far off): once no bytes came
    for a few seconds by the database's clock, the pull reads running with
    rate 0, no time left and a message saying for how long; control: once
    released, it ends done with its rate and an empty message."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 300)
    started = (await manager.post("/v1/pulls", json={"source": SOURCE})).json()
    stall = hub.stall(REPO, FILE)
    running = asyncio.create_task(run_pull(started["id"]))
    try:
        assert await asyncio.to_thread(stall.reached.wait, 60), "never stalled"

        async def stalled():
            now = (await manager.get(f"/v1/pulls/{started['id']}")).json()
            return now["message"].startswith("no bytes for ") and now

        seen = await await_for(stalled, what="the pull read as stalled")
        assert (seen["status"], seen["rate_bytes_per_s"]) == ("running", 0.0)
        assert seen["seconds_left"] is None and seen["done_bytes"] > 0
        fits(bodies.ModelPull, seen)
    finally:
        stall.release.set()
    assert await asyncio.wait_for(running, 120) == PullStatus.DONE
    done = (await manager.get(f"/v1/pulls/{started['id']}")).json()
    assert done["message"] == "" and done["rate_bytes_per_s"] > 0


async def test_a_pull_without_a_node_on_a_cluster_goes_where_it_is_placed(hub, manager):
    """Two ready nodes and this host's engine disabled: a pull that names no
    node runs on the node where its first replica would be placed (b, the
    roomier), the reason kept on its row. Control: one that names a, on a."""

    def cluster() -> None:
        EngineSpec.objects.filter(node=None).update(enabled=False)
        for name, ram_mib in (("a", 4096), ("b", 65536)):
            spec = node_with_engine(name, f"cpu-{name}")
            Node.objects.filter(pk=spec.node_id).update(hardware={"ram_mib": ram_mib})

    await sync_to_async(cluster)()
    response = await manager.post("/v1/pulls", json={"source": SOURCE})
    assert response.status_code == 202, response.text
    assert response.json()["node"] == "b"
    row = await ModelPull.objects.aget(pk=response.json()["id"])
    assert row.node_reason == "node b: where its first replica would be placed (cpu-b)"
    asked = await manager.post(
        "/v1/pulls", json={"source": SOURCE, "name": "smol-a", "node": "a"}
    )
    assert asked.status_code == 202, asked.text
    assert asked.json()["node"] == "a"


async def test_a_queued_pull_is_cancelled_at_once(hub, manager):
    """No worker holds it: DELETE answers it cancelled, and its stream ends."""
    started = (await manager.post("/v1/pulls", json={"source": SOURCE})).json()
    cancelled = (await manager.delete(f"/v1/pulls/{started['id']}")).json()
    assert (cancelled["status"], cancelled["message"]) == ("cancelled", "cancelled")
    followed = await manager.get(f"/v1/pulls/{started['id']}/events")
    assert [e["status"] for e in events(followed.content)] == ["cancelled"]


async def test_a_caller_that_hangs_up_ends_the_stream(app):
    """A queued pull's stream would go on until the pull ends; the caller
    hanging up after its first event ends it (control: the first event came,
    the stream was open)."""
    key = await sync_to_async(key_of)(manages_models=True)
    pull = await ModelPull.objects.acreate(source=SOURCE, name="waiting")
    path = f"/v1/pulls/{pull.pk}/events"
    first_event = asyncio.Event()
    answer: dict = {"status": 0, "body": b""}

    async def receive():
        if not answer.get("asked"):
            answer["asked"] = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await first_event.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message.get("body"):
            answer["body"] += message["body"]
            first_event.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Bearer {key}".encode()),
        ],
        "client": ("10.0.0.9", 40000),
        "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(app(scope, receive, send), 60)
    assert answer["status"] == 200
    assert [e["status"] for e in events(answer["body"])] == ["queued"]
    assert (await ModelPull.objects.aget(pk=pull.pk)).status == PullStatus.QUEUED


# -- deleting a model ---------------------------------------------------------------


def model_with_file(name: str, size: int) -> Path:
    """A model of the catalog with a file of `size` bytes under the models
    directory; its path."""
    path = Path(settings.MODELS_DIR) / f"org--{name}" / f"{name}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    ModelConfigFactory(name=name, path=f"org--{name}/{name}.gguf")
    return path


def node_with_engine(node: str, engine: str) -> EngineSpec:
    """A ready node of the cluster with an engine serving GGUF."""
    now = timezone.now()
    found = Node.objects.create(
        name=node, address="10.0.0.2", joined_at=now, last_heartbeat=now
    )
    return EngineSpecFactory(name=engine, capabilities=["gguf"], node=found)


async def test_a_model_loaded_anywhere_is_not_deleted(hub, manager):
    """Loaded on another node's engine (not this host's; the model disabled,
    so placed nowhere): 409 with where, row and file kept; control: once
    that engine is stopped, deleted, its bytes freed."""
    path = await sync_to_async(model_with_file)("smol", 4096)
    await ModelConfig.objects.filter(name="smol").aupdate(enabled=False)
    spec = await sync_to_async(node_with_engine)("b", "cpu-b")
    await EngineState.objects.acreate(
        spec=spec, status="ready", resident_models=[{"name": "smol"}]
    )
    message = refusal(
        await manager.delete("/v1/models/smol"), 409, errors.ApiCode.MODEL_IN_USE
    )
    assert "smol is loaded on cpu-b (node b)" in message
    assert path.exists() and await ModelConfig.objects.filter(name="smol").aexists()

    await EngineState.objects.filter(spec=spec).aupdate(status="stopped")
    response = await manager.delete("/v1/models/smol")
    assert response.status_code == 200, response.text
    fits(bodies.ModelDeleted, response.json())
    assert response.json() == {
        "id": "smol",
        "object": "model",
        "deleted": True,
        "bytes_freed": 4096,
    }
    assert not path.exists()
    assert not await ModelConfig.objects.filter(name="smol").aexists()


async def test_a_model_placed_on_a_node_is_not_deleted(hub, manager):
    """A replica placed on a node's engine (it would be loaded there): 409;
    control: the model disabled (placed nowhere), deleted."""
    path = await sync_to_async(model_with_file)("placed", 1024)
    await sync_to_async(node_with_engine)("a", "cpu-a")
    message = refusal(
        await manager.delete("/v1/models/placed"), 409, errors.ApiCode.MODEL_IN_USE
    )
    assert "placed on cpu-a (node a, replica 1)" in message
    assert path.exists()
    await ModelConfig.objects.filter(name="placed").aupdate(enabled=False)
    response = await manager.delete("/v1/models/placed")
    assert response.status_code == 200, response.text
    assert not path.exists()


async def test_an_unknown_model_is_404(manager):
    refusal(
        await manager.delete("/v1/models/no-such-model"),
        404,
        errors.ApiCode.MODEL_NOT_FOUND,
    )


# -- the admin -----------------------------------------------------------------------


def test_the_admin_shows_and_sets_whether_a_key_manages_models(admin_client):
    """The key's form has the box, with what it allows; ticking it saves it
    (control: a key added without it does not manage models)."""
    page = admin_client.get(reverse("admin:api_apikey_add")).content.decode()
    assert 'name="manages_models"' in page
    assert "May pull and delete models" in page
    fields = {"owner": "", "rpm_limit": "0", "max_concurrent": "0"}
    url = reverse("admin:api_apikey_add")
    admin_client.post(url, {"name": "plain", **fields})
    admin_client.post(url, {"name": "ci", "manages_models": "on", **fields})
    managing = dict(ApiKey.objects.values_list("name", "manages_models"))
    assert managing == {"plain": False, "ci": True}


# -- the document -------------------------------------------------------------------


def test_the_endpoints_are_in_the_openapi_document():
    """Each endpoint, its request body and its answers' typed bodies."""
    paths = openapi.openapi_document()["paths"]
    create = paths["/v1/pulls"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/PullRequest"
    }
    assert {"202", "400", "401", "403", "404", "409"} <= set(create["responses"])
    assert "200" not in create["responses"]
    one = paths["/v1/pulls/{pull_id}"]
    assert set(one) == {"get", "delete"}
    stream = paths["/v1/pulls/{pull_id}/events"]["get"]["responses"]["200"]
    assert set(stream["content"]) == {"text/event-stream"}
    delete = paths["/v1/models/{name}"]["delete"]["responses"]
    assert {"200", "403", "404", "409"} <= set(delete)
    schemas = openapi.openapi_document()["components"]["schemas"]
    assert {"PullRequest", "ModelPull", "ModelPullList", "ModelDeleted"} <= set(schemas)
