"""Whether a model fits before its download (fleet/fit.py): the arithmetic on
plain data (one card, two unequal cards, nothing big enough, a host that
reports totals only), and the places gathered from the engines, their nodes'
heartbeats and this host's device probes."""

import json

import pytest

from cluster.models import Node
from fleet.fit import EngineFacts, Place, fit_lines, fit_places, places
from fleet.models import EngineSpec, EngineState
from tests.factories import EngineSpecFactory

GIB = 1024


def test_one_card_with_room_says_what_is_spare():
    """Control: the same card with less free says it fits nowhere."""
    roomy = [Place(engine="gpu0", node="a", gpu=True, free_mib=8 * GIB)]
    assert fit_lines(6.8 * GIB, roomy) == ["fits on gpu0 (node a), 1.2 GiB to spare"]
    tight = [Place(engine="gpu0", node="a", gpu=True, free_mib=6 * GIB)]
    assert fit_lines(6.8 * GIB, tight) == [
        "fits nowhere: needs 6.8 GiB, the largest free is 6.0 GiB on gpu0 (node a)"
    ]


def test_two_unequal_cards_only_the_larger_fits():
    """The roomier card is named, the smaller is not; both fit a small model,
    roomiest first."""
    cards = [
        Place(engine="gpu-1", node="", gpu=True, free_mib=4 * GIB),
        Place(engine="gpu-2", node="", gpu=True, free_mib=12 * GIB),
    ]
    assert fit_lines(6 * GIB, cards) == ["fits on gpu-2, 6.0 GiB to spare"]
    assert fit_lines(512, cards) == [
        "fits on gpu-2, 11.5 GiB to spare",
        "fits on gpu-1, 3.5 GiB to spare",
    ]


def test_nothing_big_enough_names_the_largest_free():
    where = [
        Place(engine="cpu0", node="a", gpu=False, free_mib=3 * GIB),
        Place(engine="gpu-2", node="b", gpu=True, free_mib=7.1 * GIB),
    ]
    assert fit_lines(9.8 * GIB, where) == [
        "fits nowhere: needs 9.8 GiB, the largest free is 7.1 GiB on gpu-2 (node b)"
    ]


def test_no_engine_and_an_unreported_host_are_said():
    assert fit_lines(100, []) == [
        "no engine serves it: add one (Fleet -> Engine specs)"
    ]
    silent, cardless = places(
        [
            EngineFacts(name="cpu1", node="c", gpu=False),
            EngineFacts(name="gpu9", node="d", gpu=True, devices=("GPU-9",)),
        ],
        {"d": {"ram_mib": 1024, "gpus": []}},
    )
    assert fit_lines(100, [silent, cardless]) == [
        "cpu1 (node c): free memory not known, its node has not reported its "
        "memory yet (no heartbeat)",
        "gpu9 (node d): free memory not known, its host has none of its cards (GPU-9)",
    ]


def test_reported_free_memory_is_used_as_it_is():
    """A heartbeat with free figures: RAM for a CPU engine, the owned card's
    free memory for a GPU engine (not the other card's)."""
    hardware = {
        "a": {
            "ram_mib": 64 * GIB,
            "ram_free_mib": 20 * GIB,
            "gpus": [
                {"names": ["GPU-x", "0"], "memory_mib": 24 * GIB, "free_mib": 10 * GIB},
                {"names": ["GPU-y", "1"], "memory_mib": 8 * GIB, "free_mib": 2 * GIB},
            ],
        }
    }
    engines = [
        EngineFacts(name="cpu0", node="a", gpu=False, rss_mib=5 * GIB),
        EngineFacts(name="gpu1", node="a", gpu=True, devices=("1",)),
        EngineFacts(name="both", node="a", gpu=True),
    ]
    free = {place.engine: place.free_mib for place in places(engines, hardware)}
    assert free == {"cpu0": 20 * GIB, "gpu1": 2 * GIB, "both": 12 * GIB}


def test_totals_only_are_less_what_the_engines_hold():
    """A heartbeat without free figures (an older node): its RAM less its
    engines' RSS, a card's memory less the models its engines hold."""
    hardware = {
        "a": {
            "ram_mib": 16 * GIB,
            "gpus": [{"names": ["GPU-x", "0"], "memory_mib": 24 * GIB}],
        }
    }
    engines = [
        EngineFacts(name="cpu0", node="a", gpu=False, rss_mib=4 * GIB),
        EngineFacts(
            name="gpu0",
            node="a",
            gpu=True,
            devices=("GPU-x",),
            rss_mib=2 * GIB,
            resident_mib=6 * GIB,
        ),
        EngineFacts(name="cpu-b", node="b", gpu=False, rss_mib=1 * GIB),
    ]
    free = {place.engine: place.free_mib for place in places(engines, hardware)}
    assert free == {"cpu0": 10 * GIB, "gpu0": 18 * GIB, "cpu-b": None}


@pytest.mark.django_db
def test_places_are_gathered_from_engines_nodes_and_this_host(tmp_path, settings):
    """Engines on one host read this host's cards now (the probes' file);
    an engine on a node reads its heartbeat; a disabled engine (the seeded
    cpu0 too), one that does not serve the format and one on a revoked node
    are left out."""
    EngineSpec.objects.update(enabled=False)
    cards = tmp_path / "cards.json"
    cards.write_text(
        json.dumps({"gpus": [{"id": "GPU-1", "total_mib": 8192, "used_mib": 8000}]})
    )
    settings.ROUNDHOUSE_DEVICE_MEMORY_FILE = str(cards)
    node = Node.objects.create(
        name="b", address="10.0.0.2", hardware={"ram_mib": 4096, "gpus": []}
    )
    revoked = Node.objects.create(name="gone", address="10.0.0.3")
    Node.objects.filter(pk=revoked.pk).update(revoked_at="2026-01-01T00:00Z")
    EngineSpecFactory(name="gpu0", backend="cuda", devices="GPU-1")
    on_b = EngineSpecFactory(name="cpu-b", backend="cpu", node=node)
    EngineState.objects.create(spec=on_b, memory_mib=1024)
    EngineSpecFactory(name="off", backend="cpu", enabled=False)
    EngineSpecFactory(name="torch", backend="cuda", capabilities=["transformers"])
    EngineSpecFactory(name="cpu-gone", backend="cpu", node=revoked)
    found = {place.engine: place for place in fit_places(model_format="gguf")}
    assert set(found) == {"gpu0", "cpu-b"}
    assert found["gpu0"].free_mib == pytest.approx(192)
    assert found["cpu-b"].free_mib == 3072
    assert fit_lines(1000, found.values()) == [
        "fits on cpu-b (node b), 2.0 GiB to spare"
    ]
