"""Engine selection: pin, residency, default, load; owners; the snapshot cache."""

import dataclasses
import logging
import sys
import threading

import pytest

from routing.compat import capabilities_for
from routing.select import (
    LOGGER_NAME,
    Choice,
    EngineStatus,
    ModelRoute,
    NoEngine,
    Router,
    Snapshot,
    SnapshotCache,
    assign_owners,
)
from tests.waiting import wait_for


def engine(name, backend="cpu", *, up=True, order=0, resident=(), **kwargs):
    return EngineStatus(
        name=name,
        backend=backend,
        capabilities=capabilities_for(backend),
        up=up,
        order=order,
        resident=frozenset(resident),
        **kwargs,
    )


def snapshot(*engines, models=(), default=""):
    return Snapshot(
        engines={e.name: e for e in engines},
        models={m.name: m for m in models},
        default_engine=default,
    )


def pin_warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER_NAME]


CHAT = ModelRoute("chat", "gguf")
TORCH = ModelRoute("torch-chat", "transformers")


# --- precedence ---------------------------------------------------------------


def test_valid_pin_beats_residency_default_and_load(caplog):
    """A pin to an up, compatible engine wins over every other rule."""
    model = ModelRoute("chat", "gguf", pin="gpu1")
    snap = snapshot(
        engine("cpu0", resident={"chat"}),
        engine("gpu0", "cuda"),
        engine("gpu1", "cuda", queue_depth=9, slots_in_use=4),
        default="gpu0",
    )
    choice = Router().choose(model, snap)
    assert (choice.engine, choice.rule) == ("gpu1", "pin")
    assert pin_warnings(caplog) == []


def test_resident_beats_default():
    """An engine already holding the model wins over the default engine."""
    snap = snapshot(
        engine("cpu0", resident={"chat"}, queue_depth=5),
        engine("gpu0", "cuda"),
        default="gpu0",
    )
    choice = Router().choose(CHAT, snap)
    assert (choice.engine, choice.rule) == ("cpu0", "resident")


def test_resident_on_several_engines_picks_the_least_loaded():
    """While a model is transiently resident twice, the less busy copy serves."""
    snap = snapshot(
        engine("a", resident={"chat"}, queue_depth=3, slots_in_use=1),
        engine("b", resident={"chat"}, slots_in_use=2),
        engine("c"),
    )
    choice = Router().choose(CHAT, snap)
    assert (choice.engine, choice.rule) == ("b", "resident")


def test_default_beats_least_loaded():
    """The default engine serves a non-resident model even when busier."""
    snap = snapshot(
        engine("cpu0"),
        engine("gpu0", "cuda", queue_depth=7, slots_in_use=3),
        default="gpu0",
    )
    choice = Router().choose(CHAT, snap)
    assert (choice.engine, choice.rule) == ("gpu0", "default")


@pytest.mark.parametrize(
    "default",
    ["radeon", "nowhere", ""],
    ids=["incompatible", "unknown", "unset"],
)
def test_unusable_default_falls_to_least_loaded(default):
    """A default that cannot serve the format leaves the choice to load."""
    snap = snapshot(
        engine("radeon", "vulkan"),
        engine("cpu0", queue_depth=2),
        engine("gpu0", "cuda", slots_in_use=1),
        default=default,
    )
    choice = Router().choose(TORCH, snap)
    assert (choice.engine, choice.rule) == ("gpu0", "least-loaded")


def test_least_loaded_counts_queue_and_slots():
    """Load is queue depth plus slots in use, lowest wins."""
    snap = snapshot(
        engine("a", queue_depth=0, slots_in_use=3),
        engine("b", queue_depth=1, slots_in_use=1),
        engine("c", queue_depth=2, slots_in_use=2),
    )
    assert Router().choose(CHAT, snap).engine == "b"


def test_cooling_engine_sorts_after_warm_ones():
    """An idle cooling engine loses to a busy engine that is not cooling."""
    snap = snapshot(
        engine("hot", cooling=True),
        engine("busy", queue_depth=4, slots_in_use=4),
    )
    assert Router().choose(CHAT, snap).engine == "busy"
    only_cooling = snapshot(engine("hot", cooling=True))
    assert Router().choose(CHAT, only_cooling).engine == "hot"


def test_load_ties_go_to_the_owner_then_order_then_name():
    """Equal load: the model's owner first, then engine order, then name."""
    engines = [engine("b", order=1), engine("a", order=1), engine("z", order=0)]
    # Four models balanced over three engines: "m2" is owned by "a", "m3" by "b".
    models = [ModelRoute(f"m{i}", "gguf") for i in range(1, 5)]
    snap = snapshot(*engines, models=models)
    assert snap.owners() == {"m1": "z", "m2": "a", "m3": "b", "m4": "z"}
    router = Router()
    assert router.choose(ModelRoute("m3", "gguf"), snap).engine == "b"
    assert router.choose(ModelRoute("m2", "gguf"), snap).engine == "a"
    # Not a configured model, so no owner: lowest order, then name.
    assert router.choose(ModelRoute("other", "gguf"), snap).engine == "z"
    no_z = snapshot(engine("b", order=1), engine("a", order=1))
    assert router.choose(ModelRoute("other", "gguf"), no_z).engine == "a"


# --- down engines -------------------------------------------------------------


def test_down_engines_are_skipped_by_every_rule():
    """The pinned, resident, default and idlest engines are down: a busy one serves."""
    model = ModelRoute("chat", "gguf", pin="pinned")
    snap = snapshot(
        engine("pinned", up=False),
        engine("holder", up=False, resident={"chat"}),
        engine("default", up=False),
        engine("idle", up=False),
        engine("busy", queue_depth=6),
        default="default",
    )
    choice = Router().choose(model, snap)
    assert (choice.engine, choice.rule) == ("busy", "least-loaded")


def test_down_resident_engine_leaves_it_to_the_default():
    """A model resident only on a down engine goes to the default."""
    snap = snapshot(
        engine("holder", up=False, resident={"chat"}),
        engine("gpu0", "cuda"),
        default="gpu0",
    )
    choice = Router().choose(CHAT, snap)
    assert (choice.engine, choice.rule) == ("gpu0", "default")


def test_disabled_engine_is_never_chosen():
    """An engine disabled in the admin but still up (draining) gets no requests."""
    snap = snapshot(
        engine("old", enabled=False, resident={"chat"}),
        engine("new", queue_depth=3),
        default="old",
    )
    choice = Router().choose(CHAT, snap)
    assert (choice.engine, choice.rule) == ("new", "least-loaded")


# --- bad pins -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pin", "problem"),
    [
        ("gpu9", "engine 'gpu9' does not exist (known engines: cpu0, gpu0, radeon)"),
        ("radeon", "engine 'radeon' (vulkan) cannot serve transformers models"),
        ("gpu0", "engine 'gpu0' is down"),
    ],
    ids=["unknown", "incompatible", "down"],
)
def test_bad_pin_falls_through_and_is_logged_once(caplog, pin, problem):
    """A pin that cannot be honoured is reported once, then the next rule applies."""
    model = ModelRoute("torch-chat", "transformers", pin=pin)
    snap = snapshot(
        engine("cpu0", resident={"torch-chat"}),
        engine("gpu0", "cuda", up=False),
        engine("radeon", "vulkan"),
    )
    router = Router()
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    choices = [router.choose(model, snap) for _ in range(3)]
    assert [(c.engine, c.rule) for c in choices] == [("cpu0", "resident")] * 3
    records = pin_warnings(caplog)
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert message.startswith("model 'torch-chat': pin ignored, ")
    assert problem in message


def test_bad_pin_is_logged_once_per_model_and_engine(caplog):
    """Two models pinned to the same bad engine each get their own line."""
    first = ModelRoute("a", "gguf", pin="gone")
    second = ModelRoute("b", "gguf", pin="gone")
    snap = snapshot(engine("cpu0"))
    router = Router()
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    for _ in range(2):
        router.choose(first, snap)
        router.choose(second, snap)
    messages = [r.getMessage() for r in pin_warnings(caplog)]
    assert len(messages) == 2
    assert messages[0].startswith("model 'a': ")
    assert messages[1].startswith("model 'b': ")


def test_pin_to_disabled_engine_falls_through(caplog):
    """A pin to a disabled engine is reported and ignored."""
    model = ModelRoute("chat", "gguf", pin="off")
    snap = snapshot(engine("off", enabled=False), engine("cpu0"))
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    choice = Router().choose(model, snap)
    assert (choice.engine, choice.rule) == ("cpu0", "least-loaded")
    assert "engine 'off' is disabled" in pin_warnings(caplog)[0].getMessage()


def test_pin_that_recovers_and_fails_again_is_reported_again(caplog):
    """Once a pin works again, its next failure is news and is logged."""
    model = ModelRoute("chat", "gguf", pin="gpu0")
    down = snapshot(engine("gpu0", "cuda", up=False), engine("cpu0"))
    up = snapshot(engine("gpu0", "cuda"), engine("cpu0"))
    router = Router()
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    rules = [router.choose(model, s).rule for s in (down, down, up, down)]
    assert rules == ["least-loaded", "least-loaded", "pin", "least-loaded"]
    assert len(pin_warnings(caplog)) == 2


def test_bad_pin_with_no_fallback_still_reports_and_raises(caplog):
    """The pin line is logged even when no other engine can take the model."""
    model = ModelRoute("chat", "gguf", pin="gpu0")
    snap = snapshot(engine("gpu0", "cuda", up=False))
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    with pytest.raises(NoEngine):
        Router().choose(model, snap)
    assert len(pin_warnings(caplog)) == 1


# --- no engine ----------------------------------------------------------------


def test_nothing_up_names_the_down_engines():
    """Compatible engines exist but none is up: the error names them."""
    snap = snapshot(
        engine("gpu1", "cuda", up=False),
        engine("cpu0", up=False),
        engine("radeon", "vulkan"),
    )
    with pytest.raises(NoEngine) as raised:
        Router().choose(TORCH, snap)
    assert raised.value.message == (
        "no engine that serves transformers is running: cpu0, gpu1 are down"
    )
    assert str(raised.value) == raised.value.message


def test_single_down_engine_message_is_singular():
    """One down engine reads 'is down'."""
    with pytest.raises(NoEngine) as raised:
        Router().choose(CHAT, snapshot(engine("cpu0", up=False)))
    assert raised.value.message == "no engine that serves gguf is running: cpu0 is down"


def test_no_compatible_engine_says_to_configure_one():
    """No engine serves the format at all: the error says to configure one."""
    snap = snapshot(engine("radeon", "vulkan"), engine("radeon2", "vulkan"))
    with pytest.raises(NoEngine) as raised:
        Router().choose(TORCH, snap)
    assert raised.value.message == (
        "no engine can serve transformers models; configure one in the admin"
    )
    with pytest.raises(NoEngine) as raised:
        Router().choose(CHAT, snapshot())
    assert raised.value.message == (
        "no engine can serve gguf models; configure one in the admin"
    )


def test_only_disabled_compatible_engines_says_so():
    """When the only engines that could serve are disabled, the error names them."""
    snap = snapshot(engine("cpu0", enabled=False), engine("radeon", "vulkan"))
    with pytest.raises(NoEngine) as raised:
        Router().choose(TORCH, snap)
    assert raised.value.message == (
        "no engine can serve transformers models (cpu0 is disabled); "
        "enable or configure one in the admin"
    )


# --- owners -------------------------------------------------------------------


def test_unpinned_models_are_balanced_across_compatible_engines():
    """Four models, two cpu engines, no default: two each, in name order."""
    models = [ModelRoute(name, "gguf") for name in ("d", "b", "a", "c")]
    owners = assign_owners(models, {"x": engine("x"), "y": engine("y")}, "")
    assert owners == {"a": "x", "b": "y", "c": "x", "d": "y"}


def test_owners_follow_pin_then_default():
    """A valid pin owns even while down; otherwise a compatible default owns."""
    engines = {
        "cpu0": engine("cpu0"),
        "gpu0": engine("gpu0", "cuda", up=False),
        "radeon": engine("radeon", "vulkan"),
    }
    models = [
        ModelRoute("pinned-down", "gguf", pin="gpu0"),
        ModelRoute("pinned-bad", "transformers", pin="radeon"),
        ModelRoute("pinned-unknown", "gguf", pin="gpu9"),
        ModelRoute("plain", "gguf"),
    ]
    owners = assign_owners(models, engines, "cpu0")
    assert owners == {
        "pinned-down": "gpu0",
        "pinned-bad": "cpu0",
        "pinned-unknown": "cpu0",
        "plain": "cpu0",
    }


def test_incompatible_default_falls_to_balancing_counting_pinned_models():
    """Balancing counts every pinned model, whatever its name sorts as."""
    engines = {
        "gpu0": engine("gpu0", "cuda", order=0),
        "gpu1": engine("gpu1", "cuda", order=1),
        "radeon": engine("radeon", "vulkan"),
    }
    models = [
        ModelRoute("a", "transformers"),
        ModelRoute("b", "transformers"),
        ModelRoute("z", "transformers", pin="gpu0"),
    ]
    owners = assign_owners(models, engines, "radeon")
    assert owners == {"a": "gpu1", "b": "gpu0", "z": "gpu0"}


def test_model_without_compatible_engine_has_no_owner():
    """A format nothing serves leaves the model out of the owner map."""
    engines = {
        "radeon": engine("radeon", "vulkan"),
        "off": engine("off", enabled=False),
    }
    models = [ModelRoute("emb", "embedding"), ModelRoute("chat", "gguf")]
    assert assign_owners(models, engines, "off") == {"chat": "radeon"}


def test_snapshot_owners_match_assign_owners_and_cannot_be_altered():
    """Snapshot.owners() is assign_owners over its contents, handed out as a copy."""
    models = [ModelRoute("a", "gguf"), ModelRoute("b", "gguf", pin="y")]
    snap = snapshot(engine("x"), engine("y"), models=models, default="x")
    owners = snap.owners()
    assert owners == {"a": "x", "b": "y"}
    owners["a"] = "y"
    assert snap.owners() == {"a": "x", "b": "y"}
    assert snap.owner_of("a") == "x"
    assert snap.owner_of("missing") is None


# --- snapshot cache -----------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def counting_loader():
    calls = []

    def load():
        calls.append(1)
        return Snapshot(engines={}, models={}, taken_at=float(len(calls)))

    return load, calls


def test_cache_reloads_at_most_once_per_max_age():
    """Within max_age_s the same snapshot is returned; at max_age_s it reloads."""
    clock = FakeClock()
    load, calls = counting_loader()
    cache = SnapshotCache(load, max_age_s=1.0, clock=clock)
    first = cache.get()
    clock.now += 0.999
    assert cache.get() is first
    assert len(calls) == 1
    clock.now += 0.001
    second = cache.get()
    assert second is not first
    assert second.taken_at == 2.0
    assert cache.get() is second
    assert len(calls) == 2


def test_cache_invalidate_forces_a_reload():
    """After invalidate() the next get() loads, however young the snapshot."""
    clock = FakeClock()
    load, calls = counting_loader()
    cache = SnapshotCache(load, clock=clock)
    first = cache.get()
    cache.invalidate()
    assert cache.get() is not first
    assert len(calls) == 2


def test_cache_loader_error_propagates_and_is_retried():
    """A failed load is not cached: the caller sees it, the next get() retries."""
    clock = FakeClock()
    outcomes = [RuntimeError("database gone"), Snapshot(engines={}, models={})]

    def load():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    cache = SnapshotCache(load, clock=clock)
    with pytest.raises(RuntimeError, match="database gone"):
        cache.get()
    assert cache.get().engines == {}
    assert outcomes == []


def test_cache_loads_once_for_concurrent_callers():
    """Threads asking for a stale snapshot at once share one load."""
    threads_count = 8
    start = threading.Barrier(threads_count)
    calls = []

    def asking() -> int:
        """The threads blocked in cache.get (on its lock), other than this one."""
        me = threading.get_ident()
        return sum(
            frame.f_code is SnapshotCache.get.__code__
            for ident, frame in sys._current_frames().items()
            if ident != me
        )

    def slow_load():
        calls.append(1)
        # Keep the load in flight until every other thread has asked.
        wait_for(
            lambda: asking() == threads_count - 1,
            timeout=10,
            what="every other thread waiting on the load",
        )
        return Snapshot(engines={}, models={})

    cache = SnapshotCache(slow_load)
    results = []

    def ask():
        start.wait()
        results.append(cache.get())

    threads = [threading.Thread(target=ask) for _ in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(calls) == 1
    assert len(results) == threads_count
    assert all(result is results[0] for result in results)


def test_node_labels_bind_every_rule_but_the_pin():
    """A model that must run on a gpu-labelled node is never routed to an
    engine of another node, even one holding it or the default; with none
    left the error names the labels. A pin still wins."""
    from routing.placement import NodeRoute

    engines = {
        name: EngineStatus(
            name=name,
            backend="cpu",
            capabilities=frozenset({"gguf"}),
            up=True,
            resident=frozenset({"m"}) if name == "plain" else frozenset(),
            node=name,
        )
        for name in ("plain", "gpu")
    }
    nodes = {
        "plain": NodeRoute(name="plain", status="ready"),
        "gpu": NodeRoute(name="gpu", status="ready", labels=frozenset({"gpu"})),
    }
    model = ModelRoute(name="m", format="gguf", node_labels=frozenset({"gpu"}))
    snap = Snapshot(
        engines=engines, models={"m": model}, default_engine="plain", nodes=nodes
    )
    assert Router().choose(model, snap).engine == "gpu"
    free = ModelRoute(name="m", format="gguf")
    assert Router().choose(free, snap).engine == "plain"  # control: no labels
    down = dict(engines, gpu=dataclasses.replace(engines["gpu"], up=False))
    with pytest.raises(NoEngine, match="on a node labelled gpu"):
        Router().choose(model, dataclasses.replace(snap, engines=down))
    pinned = dataclasses.replace(model, pin="plain")
    assert Router().choose(pinned, snap).rule == "pin"


def test_a_placed_replica_whose_files_are_being_copied_gets_no_requests():
    """`m` has two replicas, placed on x (node nx) and y (node ny), loaded on
    neither. While ny copies m's files, requests go to x, though y is less
    loaded (control: nothing copying, y is chosen); while both copy, NoEngine
    says so."""
    from routing.placement import NodeRoute

    engines = {
        "x": engine("x", node="nx", queue_depth=3),
        "y": engine("y", node="ny"),
    }
    model = ModelRoute(name="m", format="gguf", replicas=2)

    def snap(*copying_on):
        nodes = {
            name: NodeRoute(
                name=name,
                status="ready",
                copying=frozenset({"m"}) if name in copying_on else frozenset(),
            )
            for name in ("nx", "ny")
        }
        return Snapshot(engines=engines, models={"m": model}, nodes=nodes)

    assert set(snap().placed("m")) == {"x", "y"}
    assert Router().choose(model, snap()) == Choice("y", "placed")  # control
    assert Router().choose(model, snap("ny")) == Choice("x", "placed")
    with pytest.raises(NoEngine, match="being copied to node nx, ny"):
        Router().choose(model, snap("nx", "ny"))
