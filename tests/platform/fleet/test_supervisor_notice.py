"""A plain `manage.py supervise` (no --node) on a platform whose enabled
engine specs all belong to nodes runs no engine: it says so at start, in its
log and its output, and says to run `supervise --node NAME` instead (the
first host's switch-over to a node)."""

import signal

from cluster.models import Node
from fleet.models import EngineSpec
from tests.waiting import wait_for

NOTICE = "every enabled engine spec belongs to a node"


def stopped_output(fleet, process) -> str:
    process.send_signal(signal.SIGTERM)
    process.wait(60)
    return fleet.supervisor_log()


def test_a_plain_supervisor_whose_specs_are_all_on_nodes_says_what_to_run(fleet):
    """cpu0 belongs to node `first`: the plain supervisor logs the notice at
    start (naming the node and its spec) and writes it to its output."""
    node = Node.objects.create(name="first", address="10.0.0.1")
    EngineSpec.objects.filter(name="cpu0").update(node=node)
    supervisor = fleet.start()
    wait_for(lambda: NOTICE in fleet.supervisor_log(), timeout=60, what="the notice")
    output = stopped_output(fleet, supervisor)
    lines = [line for line in output.splitlines() if NOTICE in line]
    assert len(lines) == 2, output  # the log's line and the command's output
    assert all("(first: cpu0)" in line for line in lines)
    assert all("supervise --node NAME" in line for line in lines)


def test_a_plain_supervisor_with_its_own_engines_says_nothing_of_nodes(fleet):
    """Control: cpu0 belongs to no node: the supervisor runs it, and says
    nothing of nodes."""
    supervisor = fleet.start()
    fleet.ready()
    output = stopped_output(fleet, supervisor)
    assert NOTICE not in output
