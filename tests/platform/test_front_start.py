"""The front builds its long-lived parts when it starts, never at import: the
gateway (which reads the cluster's CA files), the usage writer, the feed."""

import json

from tests.conftest import run_python

PROBE = """
import asyncio, json, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")
from roundhouse import asgi
from api.gateway import front_gateway
from api.usage import usage_writer
from chat.dashboard import fleet_feed

def built():
    parts = (front_gateway, usage_writer, fleet_feed)
    return [part.built() is not None for part in parts]

report = {"imported": built()}
sent = []

async def lifespan():
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    await asgi.application({"type": "lifespan"}, receive, send)

asyncio.run(lifespan())
report["started"] = built()
report["sent"] = sent
print(json.dumps(report))
"""


def start(tmp_path, **env) -> dict:
    result = run_python(PROBE, env={"ROUNDHOUSE_RUN_DIR": str(tmp_path), **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_front_builds_its_parts_at_startup_not_at_import(tmp_path):
    report = start(tmp_path)
    assert report["imported"] == [False, False, False]
    assert report["started"] == [True, True, True]
    assert [message["type"] for message in report["sent"]] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]


def test_a_bad_setting_fails_the_start_with_its_reason(tmp_path):
    """A private CA named but missing: importing still works (control: the
    import is not where it fails), the lifespan's startup fails, saying why."""
    report = start(
        tmp_path,
        ROUNDHOUSE_CLUSTER_CA=str(tmp_path / "missing-ca.pem"),
        ROUNDHOUSE_CLUSTER_CERT=str(tmp_path / "missing-cert.pem"),
        ROUNDHOUSE_CLUSTER_KEY=str(tmp_path / "missing-key.pem"),
    )
    assert report["imported"] == [False, False, False]
    [failed] = report["sent"]
    assert failed["type"] == "lifespan.startup.failed"
    assert "ROUNDHOUSE_CLUSTER_CA: no file at" in failed["message"]
