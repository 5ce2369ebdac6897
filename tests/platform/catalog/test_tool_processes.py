"""The catalog's one-shot tool children (catalog.tool_processes): a real child
process gets only what a tool uses of the worker's environment."""

import os

from catalog.tool_processes import run_inspection
from engines.inspection.messages import Message

SECRETS = {
    "REDIS_URL": "redis://:hunter2@127.0.0.1:6379/0",
    "DATABASE_URL": "postgres://roundhouse:hunter2@127.0.0.1:5432/roundhouse",
    "SECRET_KEY": "not-for-tools",
    "ROUNDHOUSE_ENGINE_TOKEN": "not-for-tools",
    "HF_TOKEN": "hf_not_for_tools",
}


class Request(Message):
    ask: str = "environment"


class Names(Message):
    names: list[str] = []
    path: str = ""
    problem: str = ""


def test_a_tool_gets_none_of_the_workers_secrets(monkeypatch):
    """The worker's environment holds secrets (the control: they are set in
    this process): the tool's has none of them, and has what it uses (PATH,
    a thread count, the offline hub settings)."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set(SECRETS) <= set(os.environ)
    result = run_inspection(
        "tests.platform.catalog.environment_tool", Request(), Names, timeout_s=60
    )
    assert not result.problem, result.problem
    assert not set(SECRETS) & set(result.names)
    assert {"PATH", "OMP_NUM_THREADS", "HF_HUB_OFFLINE"} <= set(result.names)
    assert result.path == os.environ["PATH"]
