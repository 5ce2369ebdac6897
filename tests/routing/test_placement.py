"""Placement of replicas (routing.placement.place): every rule, in order."""

from routing.placement import Holder, NodeRoute, Wanted, eligible, place


def holder(name, node, *, resident=(), memory_mib=0.0, order=0, formats=("gguf",)):
    return Holder(
        name=name,
        node=node,
        capabilities=frozenset(formats),
        resident=frozenset(resident),
        memory_mib=memory_mib,
        order=order,
    )


def nodes(**statuses):
    return {
        name: NodeRoute(name=name, status=status, ram_mib=16_000)
        for name, status in statuses.items()
    }


def test_replicas_spread_over_nodes_before_doubling_up():
    """Two replicas on four engines of two nodes: one per node (control: a
    node's second engine sorts first by order and name)."""
    engines = {
        "a1": holder("a1", "a", order=0),
        "a2": holder("a2", "a", order=0),
        "b1": holder("b1", "b", order=1),
        "b2": holder("b2", "b", order=1),
    }
    placed = place(
        [Wanted("m", "gguf", replicas=2)], engines, nodes(a="ready", b="ready")
    )
    assert placed["m"] == ("a1", "b1")


def test_a_pin_wins_and_a_resident_replica_stays_put():
    engines = {n: holder(n, n) for n in ("x", "y", "z")}
    all_ready = nodes(x="ready", y="ready", z="ready")
    pinned = place([Wanted("m", "gguf", replicas=2, pin="z")], engines, all_ready)
    assert pinned["m"][0] == "z"
    engines["y"] = holder("y", "y", resident=["m"])
    stays = place([Wanted("m", "gguf", replicas=1)], engines, all_ready)
    assert stays["m"] == ("y",)  # control: without residency x sorts first
    assert place([Wanted("m", "gguf")], {**engines, "y": holder("y", "y")}, all_ready)[
        "m"
    ] == ("x",)


def test_unreachable_nodes_keep_replicas_down_draining_and_pending_do_not():
    """Through the grace period an unreachable node keeps its replica; down,
    draining, revoked and pending nodes hold none."""
    engines = {"a1": holder("a1", "a", resident=["m"]), "b1": holder("b1", "b")}
    for status, kept in (
        ("ready", True),
        ("unreachable", True),
        ("down", False),
        ("draining", False),
        ("revoked", False),
        ("pending", False),
    ):
        placed = place([Wanted("m", "gguf")], engines, nodes(a=status, b="ready"))
        assert (placed["m"] == ("a1",)) is kept, status
        if not kept:
            assert placed["m"] == ("b1",)


def test_labels_required_and_avoided():
    labelled = {
        "a": NodeRoute(name="a", status="ready", labels=frozenset({"gpu"})),
        "b": NodeRoute(name="b", status="ready", labels=frozenset({"spot"})),
    }
    engines = {"a1": holder("a1", "a"), "b1": holder("b1", "b")}
    gpu = Wanted("m", "gguf", replicas=2, node_labels=frozenset({"gpu"}))
    assert place([gpu], engines, labelled)["m"] == ("a1",)
    no_spot = Wanted("m", "gguf", replicas=2, avoid_labels=frozenset({"spot"}))
    assert place([no_spot], engines, labelled)["m"] == ("a1",)
    assert place([Wanted("m", "gguf", replicas=2)], engines, labelled)["m"] == (
        "a1",
        "b1",
    )
    # An engine of no node (one host) has no labels.
    assert not eligible(gpu, holder("solo", ""), labelled)
    assert eligible(Wanted("m", "gguf"), holder("solo", ""), labelled)


def test_memory_prefers_a_node_with_room():
    """A 10 GiB model goes to the node with room for it, not the one whose
    engines already use most of its memory (control: with no measurement the
    first by name is chosen)."""
    engines = {"a1": holder("a1", "a", memory_mib=12_000), "b1": holder("b1", "b")}
    big = Wanted("m", "gguf", memory_mib=10_000)
    assert place([big], engines, nodes(a="ready", b="ready"))["m"] == ("b1",)
    light = {"a1": holder("a1", "a"), "b1": holder("b1", "b")}
    assert place([big], light, nodes(a="ready", b="ready"))["m"] == ("a1",)


def test_models_are_balanced_over_engines_and_formats_respected():
    engines = {
        "a1": holder("a1", "a"),
        "b1": holder("b1", "b"),
        "e1": holder("e1", "b", formats=("embedding",)),
    }
    placed = place(
        [Wanted("m1", "gguf"), Wanted("m2", "gguf"), Wanted("emb", "embedding")],
        engines,
        nodes(a="ready", b="ready"),
    )
    assert placed == {"m1": ("a1",), "m2": ("b1",), "emb": ("e1",)}


def test_copy_sources_put_the_nodes_holding_the_model_first():
    """A node copies a model's files from the other serving nodes with an
    address, those whose engines hold it resident first, then by name; never
    from itself, a node not serving, or one without an address."""
    from routing.placement import copy_sources
    from routing.select import EngineStatus, Snapshot

    def node(name, status="ready", host="10.0.0.1"):
        return NodeRoute(name=name, status=status, host=host)

    snapshot = Snapshot(
        engines={
            "ec": EngineStatus(
                "ec", "cpu", frozenset(), True, node="c", resident=frozenset({"m"})
            ),
            "eb": EngineStatus("eb", "cpu", frozenset(), True, node="b"),
        },
        models={},
        nodes={
            "a": node("a"),
            "b": node("b"),
            "c": node("c"),
            "d": node("d", status="draining"),
            "e": node("e", host=""),
        },
    )
    assert [n.name for n in copy_sources(snapshot, "m", "a")] == ["c", "b"]
    # Control: a model nobody holds resident comes from the nodes by name.
    assert [n.name for n in copy_sources(snapshot, "other", "a")] == ["b", "c"]
    assert [n.name for n in copy_sources(snapshot, "m", "c")] == ["a", "b"]
