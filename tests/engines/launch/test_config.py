"""The engine configuration: one typed schema, read back exactly as written, and
anything it does not describe refused by name instead of dropped."""

import json
import os
import stat

import pytest

from engines.launch.config import (
    EngineConfig,
    Limits,
    LiveConfig,
    ModelSpec,
    Thresholds,
    VendorThresholds,
)
from engines.launch.environment import (
    CONFIG_ENV,
    CONFIG_FILE_ENV,
    MAX_ENV_STRING,
    env_problems,
)
from engines.launch.process import write_config_file


def full_config() -> EngineConfig:
    return EngineConfig(
        name="gpu0",
        port=8791,
        backend="cuda",
        limits=Limits(max_parallel_requests=8, queue_timeout_s=0.0, threads=2),
        models={
            "chat": ModelSpec(
                name="chat",
                format="gguf",
                path="/models/chat.gguf",
                task="chat",
                context_length=2048,
                slots=4,
                measured_mib=812.0,
                sampling={"temperature": 0.2, "stop": ["\n\n"]},
                chat_template="{{ messages }}",
            ),
            "embed": ModelSpec(name="embed", format="embedding", path="/m/e"),
        },
        preload=["embed"],
        thermal=Thresholds(
            gpu_high=88, overrides={"amd": VendorThresholds(high=95, resume=92)}
        ),
        devices=["GPU-1"],
        cpus=[0, 2],
    )


def test_a_configuration_reads_back_as_written():
    """to_json, then from_dict, gives the same configuration, field for field."""
    config = full_config()
    again = EngineConfig.from_dict(json.loads(config.to_json()))
    assert again == config
    assert again.to_json() == config.to_json()


def refused(read, data) -> set[tuple[tuple, str]]:
    """Each place `read(data)` refuses (the keys' path) with why (pydantic's
    error type)."""
    with pytest.raises(ValueError) as error:
        read(data)
    return {(tuple(item["loc"]), item["type"]) for item in error.value.errors()}


@pytest.mark.parametrize(
    ("change", "place", "why"),
    [
        (lambda d: d.update(host="0.0.0.0"), ("host",), "extra_forbidden"),
        (
            lambda d: d["limits"].update(max_paralel=3),
            ("limits", "max_paralel"),
            "extra_forbidden",
        ),
        (
            lambda d: d["models"][0].update(temp=1),
            ("models", "chat", "temp"),
            "extra_forbidden",
        ),
        (
            lambda d: d["thermal"].update(cpu_hot=1),
            ("thermal", "cpu_hot"),
            "extra_forbidden",
        ),
        (
            lambda d: d["thermal"]["overrides"]["amd"].pop("resume"),
            ("thermal", "overrides", "amd", "resume"),
            "missing",
        ),
        (
            lambda d: d["thermal"].update(overrides=[]),
            ("thermal", "overrides"),
            "dict_type",
        ),
        (lambda d: d.pop("port"), ("port",), "missing"),
        (lambda d: d["models"][1].pop("path"), ("models", "embed", "path"), "missing"),
        (lambda d: d.update(port="8791"), ("port",), "int_type"),
        (
            lambda d: d["limits"].update(queue_limit=True),
            ("limits", "queue_limit"),
            "int_type",
        ),
        (lambda d: d.update(cpus=["0"]), ("cpus", 0), "int_type"),
        (lambda d: d.update(models={}), ("models",), "value_error"),
        (
            lambda d: d["models"].append(d["models"][0]),
            ("models",),
            "value_error",
        ),
    ],
)
def test_unknown_missing_and_mistyped_keys_are_refused_by_name(change, place, why):
    """Each of these is a ValueError naming the key by its place, not a key
    silently dropped, converted, or a failure later; the unchanged
    configuration is the control."""
    data = json.loads(full_config().to_json())
    EngineConfig.from_dict(data)  # control: as written, it is accepted
    change(data)
    assert (place, why) in refused(EngineConfig.from_dict, data)


def test_keys_with_defaults_may_be_left_out():
    """A partial limits block (what `configure` pushes) keeps the defaults; only
    keys without a default are required."""
    config = EngineConfig.from_dict({"name": "cpu0", "port": 9000, "limits": {}})
    assert config.limits == Limits()
    assert Limits.from_dict({"queue_limit": 1}).queue_limit == 1
    assert refused(ModelSpec.from_dict, {}) == {
        (("name",), "missing"),
        (("format",), "missing"),
        (("path",), "missing"),
    }


def test_thresholds_judge_the_cpu_the_gpus_and_each_vendor_override():
    """The CPU has its own pair; a GPU takes its vendor's override where there
    is one, else the GPU defaults."""
    thresholds = full_config().thermal
    assert thresholds.for_device("cpu", "cpu") == (90, 80)
    assert thresholds.for_device("gpu", "amd") == (95, 92)
    assert thresholds.for_device("gpu", "nvidia") == (88, 75)


def test_a_live_configuration_reads_back_as_written():
    """What the supervisor pushes with `configure` (every live setting of a
    whole configuration) reads back field for field, and applied to another
    configuration gives it those settings and leaves the rest."""
    config = full_config()
    live = LiveConfig.of(config)
    again = LiveConfig.from_dict(json.loads(json.dumps(live.to_dict())))
    assert again == live
    running = EngineConfig(name="gpu0", port=9000, preload=["embed"])
    again.apply(running)
    assert (running.limits, running.models) == (config.limits, config.models)
    assert (running.thermal, running.devices) == (config.thermal, config.devices)
    assert (running.port, running.cpus) == (9000, [])


def test_a_live_configuration_changes_only_what_it_gives():
    """A push of limits alone changes the limits (the block's missing keys
    take their defaults) and leaves the models, thermal and devices."""
    running = full_config()
    live = LiveConfig.from_dict({"limits": {"queue_limit": 3}})
    assert live.to_dict() == {"limits": vars(Limits(queue_limit=3))}
    live.apply(running)
    assert running.limits == Limits(queue_limit=3)
    assert running.models == full_config().models
    assert (running.thermal, running.devices) == (full_config().thermal, ["GPU-1"])


@pytest.mark.parametrize(
    ("data", "place", "why"),
    [
        ({"port": 9000}, ("port",), "extra_forbidden"),
        ({"limits": {"max_paralel": 3}}, ("limits", "max_paralel"), "extra_forbidden"),
        ({"models": [{}]}, ("models", "0", "name"), "missing"),
        ({"models": {}}, ("models",), "value_error"),
        ({"thermal": {"cpu_hot": 1}}, ("thermal", "cpu_hot"), "extra_forbidden"),
        ({"devices": [0]}, ("devices", 0), "string_type"),
        ([], (), "model_type"),
    ],
)
def test_a_live_configuration_refuses_what_it_does_not_describe(data, place, why):
    """Each is a ValueError naming the key (the engine answers bad_request);
    an empty push, which changes nothing, is the control."""
    assert LiveConfig.from_dict({}) == LiveConfig()
    assert (place, why) in refused(LiveConfig.from_dict, data)


def test_the_configuration_file_is_private_and_deleted_once_read(tmp_path, monkeypatch):
    """A configuration too large for the environment travels in a 0600 file in
    a 0700 directory, which the engine reads and deletes."""
    config = full_config()
    path = write_config_file(config, tmp_path / "engines")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setenv(CONFIG_FILE_ENV, str(path))
    assert EngineConfig.from_env() == config
    assert not path.exists()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"A": "x\0y"}, "'A' contains a NUL character"),
        ({"BIG": "x" * MAX_ENV_STRING}, "BIG is 131,077 bytes"),
        ({f"V{i}": "x" * 1000 for i in range(10)}, "at most 5,000 fit"),
    ],
)
def test_environments_exec_would_refuse_are_named(env, message):
    """NUL characters, one variable over the system's limit, all of them over
    the budget; a harmless environment is the control."""
    assert env_problems({"A": "1", "EMPTY": ""}, budget=5000) == []
    assert any(message in problem for problem in env_problems(env, budget=5000))


def test_the_real_environment_passes():
    assert env_problems(dict(os.environ)) == []
