"""The multi-host tests' set-up and clients (their fixtures are in
conftest.py): the test cluster (`Cluster`, `open_cluster`: hosts in network
namespaces, each running `manage.py supervise --node NAME` and a front), the
catalog rows it serves, and requests to its fronts (plain HTTP, a streamed
chat read event by event, the official OpenAI client)."""

import contextlib
import json
import os
import random
import secrets
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import redis
from django.db import connection

from api.models import ApiKey, Usage
from catalog.models import ModelConfig
from cluster.models import ClusterSettings, Node
from cluster.services import node_create
from fleet.models import EngineSpec, EngineState, ServerSettings
from fleet.node_database import node_role_create, node_role_drop
from tests.cluster.netns import (
    Host,
    Network,
    node_environment,
    start_node,
)
from tests.conftest import ROOT
from tests.factories import ApiKeyFactory
from tests.waiting import wait_for

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
FRONT_PORT = 8000
ENGINE_PORT = 8780  # each host has its own loopback: every engine may use it
GRACE_S = 5.0  # ClusterSettings.grace_s for these tests


def http(url: str, *, body: dict | None = None, key: str = "", timeout=120):
    """(status, headers, parsed body) of a GET, or a POST of `body`."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"}
        | ({"Authorization": f"Bearer {key}"} if key else {}),
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.headers, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read() or b"null")


@dataclass
class TestNode:
    """One host of the test cluster and its processes."""

    name: str
    host: Host
    run_dir: Path
    env: dict
    engine: str
    log_dir: Path
    # The node's own database role (docs/operating/cluster.md, database credentials).
    supervisor_database_url: str = ""
    processes: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{FRONT_PORT}"

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120
        )

    def start(self, *, join_token: str = "") -> None:
        self.processes = start_node(
            self.host,
            self.name,
            env=self.env,
            supervisor_env={"DATABASE_URL": self.supervisor_database_url}
            if self.supervisor_database_url
            else {},
            log_dir=self.log_dir,
            root=ROOT,
            join_token=join_token,
            front_port=FRONT_PORT,
        )

    def log(self, process: str = "supervisor") -> str:
        path = self.log_dir / f"{self.name}-{process}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class Cluster:
    """The test's hosts, their rows and their processes."""

    def __init__(self, network: Network, tmp: Path, redis_url: str) -> None:
        self.network = network
        self.tmp = tmp
        self.redis_url = redis_url
        self.nodes: dict[str, TestNode] = {}
        self.tokens: dict[str, str] = {}  # each node's join token, used once
        self.key = ApiKeyFactory(name="cluster").plaintext
        self.node_env = lambda name: {}

    def database_url(self, auth: str = "") -> str:
        """The test database through the bridge, as the front's user or as
        `auth` ("role:password")."""
        db = connection.settings_dict
        if not auth:
            auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
        port = db["PORT"] or 5432
        return f"postgres://{auth}@{self.network.gateway}:{port}/{db['NAME']}"

    def add_node(
        self, name: str, *, labels: list[str], models_dir: Path | None = None
    ) -> TestNode:
        """A new host, its Node row (join token), its engine; started, and
        waited for until its engine is ready. Its models are the checkout's
        unless `models_dir` gives it a directory of its own."""
        host = self.network.add_host(name)
        node, token = node_create(name=name, address=host.address, labels=labels)
        self.tokens[name] = token
        EngineSpec.objects.create(
            name=f"e{name}", node=node, backend="cpu", capabilities=["gguf"], order=0
        )
        # The first host's supervisor keeps the full credentials (the first
        # host of docs/operating/cluster.md; it records the catalog's file
        # digests); every later one logs in as its node's own role, as "What a
        # node can and cannot do" asks of a supervisor-only host: what the
        # cluster tests do, a node role can do (fronts are trusted and keep the
        # full credentials).
        # Role names are server-wide: a fresh one.
        supervisor_database_url = ""
        if self.nodes:
            credentials = node_role_create(
                node=node, role=f"rhtest_{name}_{secrets.token_hex(4)}"
            )
            supervisor_database_url = self.database_url(
                f"{credentials.role}:{credentials.password}"
            )
        # A node name may come back (a test adds one and removes it): each
        # start of a node is a fresh host with a run dir of its own.
        run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.tmp)) / "run"
        run_dir.mkdir(mode=0o700)
        env = node_environment(
            database_url=self.database_url(),
            redis_url=self.redis_url,
            run_dir=run_dir,
            models_dir=models_dir
            or Path(os.environ.get("ROUNDHOUSE_MODELS_DIR", ROOT / "var" / "models")),
            root=ROOT,
            files_dir=self.tmp / "files",  # shared storage, as a cluster needs
        ) | self.node_env(name)
        test_node = TestNode(
            name=name,
            host=host,
            run_dir=run_dir,
            env=env,
            engine=f"e{name}",
            log_dir=self.tmp,
            supervisor_database_url=supervisor_database_url,
        )
        self.nodes[name] = test_node
        test_node.start(join_token=token)
        self.wait_ready(test_node)
        return test_node

    def wait_ready(self, node: TestNode, timeout: float = 180) -> None:
        def ready() -> bool:
            row = Node.objects.get(name=node.name)
            state = EngineState.objects.filter(spec__name=node.engine).first()
            return (
                row.last_heartbeat is not None
                and state is not None
                and state.status == "ready"
                and _up(node)
            )

        try:
            wait_for(ready, timeout=timeout, what=f"node {node.name} to be ready")
        except AssertionError:
            raise AssertionError(
                f"node {node.name} did not get ready:\n{node.log()[-3000:]}\n"
                f"{node.log('front')[-2000:]}"
            ) from None

    def remove_node(self, name: str) -> None:
        node = self.nodes.pop(name)
        node.host.stop_all(timeout=30)
        self.network.remove_host(name)
        EngineSpec.objects.filter(node__name=name).delete()
        for row in Node.objects.filter(name=name).exclude(db_role=""):
            node_role_drop(node=row)
        Node.objects.filter(name=name).delete()

    def close(self) -> None:
        for name in list(self.nodes):
            self.remove_node(name)


def _up(node: TestNode) -> bool:
    try:
        with urllib.request.urlopen(f"{node.url}/healthz", timeout=5):
            return True
    except OSError:
        return False


def model_row(name: str, **fields) -> ModelConfig:
    """SmolLM2 as a chat model of the cluster, with `fields` over the defaults."""
    defaults = {"context_length": 1024, "slots": 2, "keep_alive_s": 0}
    return ModelConfig.objects.create(
        name=name, format="gguf", task="chat", path=SMOL, **(defaults | fields)
    )


def models_rows() -> None:
    """The models the cluster serves: `smol` with a replica on each of two
    nodes, `smol-b` only where a node has the label zone-b."""
    model_row("smol", replicas=2)
    model_row("smol-b", node_labels=["zone-b"])


def wait_resident(model: str, engines: set[str], timeout: float = 120) -> None:
    """Until each of `engines` holds `model` (as its supervisor recorded)."""

    def held() -> bool:
        holding = {
            state.spec.name
            for state in EngineState.objects.select_related("spec")
            if model in state.resident_model_names
        }
        return engines <= holding

    wait_for(held, timeout=timeout, what=f"{model} resident on {sorted(engines)}")


def node_status(name: str) -> str:
    from cluster.selectors import nodes_now

    return str(nodes_now()[name].status)


def fleet_view() -> str:
    """The fleet as routing reads it now, for a failing test's message: each
    node's status, heartbeat age and what it says of its links, and each
    engine's status, heartbeat age and whether routing takes it for up."""
    from django.db.models.functions import Now

    from cluster.selectors import nodes_now
    from fleet.selectors import routing_snapshot

    lines = []
    rows = {node.name: node for node in Node.objects.all()}
    for name, view in nodes_now().items():
        lines.append(
            f"node {name}: {view.status}, beat {view.heartbeat_age_s} s ago, "
            f"reaches {rows[name].reaches}"
        )
    up = routing_snapshot().engines
    for state in EngineState.objects.select_related("spec").annotate(now=Now()):
        age = (
            (state.now - state.heartbeat_at).total_seconds()
            if state.heartbeat_at
            else None
        )
        name = state.spec.name
        lines.append(
            f"engine {name}: {state.status}, beat {age} s ago, "
            f"up {up[name].up if name in up else None}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def open_cluster(tmp: Path, django_db_blocker, *, models=models_rows, node_env=None):
    """An empty cluster (network, database rows, Redis database) whose nodes
    the caller adds; `node_env(name)`: more environment for a node's
    processes. Everything removed at the end."""
    redis_url_db = random.randint(8, 15)
    network = Network().open()
    with django_db_blocker.unblock():
        for model in (Usage, ApiKey, ModelConfig, EngineSpec, Node):
            model.objects.all().delete()
        server = ServerSettings.load()
        server.base_port, server.default_engine = ENGINE_PORT, None
        server.save()
        settings_row = ClusterSettings.load()
        settings_row.grace_s = GRACE_S
        settings_row.save()
        models()
        redis.Redis(host="127.0.0.1", port=6379, db=redis_url_db).flushdb()
        built = Cluster(network, tmp, f"redis://{network.gateway}:6379/{redis_url_db}")
        built.node_env = node_env or (lambda name: {})
    try:
        yield built
    finally:
        with django_db_blocker.unblock():
            built.close()
            for model in (Usage, ApiKey, ModelConfig, EngineSpec, Node):
                model.objects.all().delete()
        network.close()


class EventStream:
    """A streamed chat answer read event by event (SSE), closable mid-way."""

    def __init__(self, node: TestNode, body: dict, key: str) -> None:
        import http.client

        self._connection = http.client.HTTPConnection(
            node.host.address, FRONT_PORT, timeout=120
        )
        self._connection.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps({**body, "stream": True}),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {key}",
            },
        )
        self.response = self._connection.getresponse()
        self.headers = self.response.headers
        if self.response.status != 200:
            raise AssertionError(
                f"stream refused: {self.response.status} {self.response.read()!r}"
            )

    def events(self):
        """Each `data:` event's JSON, until [DONE] or the end."""
        for raw in self.response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            yield json.loads(line[6:])

    def close(self) -> None:
        self._connection.close()


def routed(front: TestNode, model: str, key: str) -> tuple:
    """(status, headers, body) of the first 200 a short chat for `model` gets
    from `front`, asked until then (at most 30 s): a front's routing view is
    up to a second old, so a replica just loaded may not be in it yet."""

    def ask() -> tuple | None:
        reply = http(
            f"{front.url}/v1/chat/completions",
            body=chat(model, "Hi", max_tokens=4),
            key=key,
        )
        return reply if reply[0] == 200 else None

    return wait_for(ask, timeout=30, what=f"front {front.name} to serve {model}")


def chat(model: str, content: str, **fields) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **fields,
    }
