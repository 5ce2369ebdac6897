"""Cache-aware routing: prefix keys, the affinity map, and the router's use
of both with replicas and load."""

from routing.affinity import MAX_PREFIXES_PER_REQUEST, AffinityMap, prefix_keys
from routing.placement import NodeRoute
from routing.select import EngineStatus, ModelRoute, Router, Snapshot


def turn(n: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"} for i in range(n)]


def test_a_next_turn_finds_the_previous_turns_prefix():
    first = turn(1)
    second = first + [{"role": "assistant", "content": "answer"}] + turn(1)
    affinity = AffinityMap()
    affinity.remember(prefix_keys("m", first), "eb")
    assert affinity.lookup(prefix_keys("m", second)) == "eb"
    # Another model's cache holds nothing of it; another conversation neither.
    assert affinity.lookup(prefix_keys("other", second)) == ""
    assert affinity.lookup(prefix_keys("m", [{"role": "user", "content": "x"}])) == ""


def test_the_longest_prefix_wins_and_keys_are_bounded():
    long = turn(40)
    keys = prefix_keys("m", long)
    assert len(keys) == MAX_PREFIXES_PER_REQUEST
    assert keys[-1] == prefix_keys("m", long[:1])[0]  # the first message's
    affinity = AffinityMap()
    affinity.remember(prefix_keys("m", long[:1]), "ea")
    affinity.remember(prefix_keys("m", long[:39]), "eb")
    assert affinity.lookup(keys) == "eb"


def test_the_map_forgets_the_least_recently_used():
    affinity = AffinityMap(capacity=2)
    for name in ("x", "y", "z"):
        affinity.remember([name], name)
    assert len(affinity) == 2 and affinity.lookup(["x"]) == ""
    assert affinity.lookup(["z"]) == "z"


def snapshot(loads: dict[str, int]) -> Snapshot:
    engines = {
        name: EngineStatus(
            name=name,
            backend="cpu",
            capabilities=frozenset({"gguf"}),
            up=True,
            resident=frozenset({"m"}),
            queue_depth=load,
            node=name[1],
        )
        for name, load in loads.items()
    }
    return Snapshot(
        engines=engines,
        models={"m": ModelRoute(name="m", format="gguf", replicas=2)},
        nodes={n: NodeRoute(name=n, status="ready") for n in ("a", "b")},
    )


def test_the_router_prefers_the_cache_unless_it_is_much_busier():
    router, model = Router(), ModelRoute(name="m", format="gguf", replicas=2)
    idle = snapshot({"ea": 0, "eb": 0})
    assert router.choose(model, idle).engine == "ea"  # control: no affinity
    choice = router.choose(model, idle, affinity="eb")
    assert (choice.engine, choice.rule) == ("eb", "affinity")
    busy = snapshot({"ea": 0, "eb": 3})
    assert router.choose(model, busy, affinity="eb").engine == "ea"


def test_requests_in_flight_spread_a_burst_over_replicas():
    """The snapshot is up to a second old: the front's own requests in flight
    count as load, so a burst does not all go to the engine idle then."""
    router, model = Router(), ModelRoute(name="m", format="gguf", replicas=2)
    idle = snapshot({"ea": 0, "eb": 0})
    assert router.choose(model, idle, in_flight={"ea": 1}).engine == "eb"
    assert router.choose(model, idle, in_flight={"ea": 1, "eb": 1}).engine == "ea"


def test_a_prefix_is_found_only_in_the_scope_that_sent_it():
    """Keys of one scope (one API key's or user's) are not another's: a
    conversation one caller sent is not found by another sending the same
    messages. The same scope finds it; the shared scope ("": a model that
    shares its cache across callers) finds it for everyone (the control)."""
    first = turn(2)
    affinity = AffinityMap()
    affinity.remember(prefix_keys("m", first, scope="key:1"), "eb")
    assert affinity.lookup(prefix_keys("m", first, scope="key:2")) == ""
    assert affinity.lookup(prefix_keys("m", first, scope="user:1")) == ""
    assert affinity.lookup(prefix_keys("m", first, scope="key:1")) == "eb"
    affinity.remember(prefix_keys("m", first), "ea")
    assert affinity.lookup(prefix_keys("m", first)) == "ea"
