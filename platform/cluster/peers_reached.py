"""What a node's supervisor last learnt from its links to the other nodes'
relays (fleet/peer_links.py), kept in its run dir (mode 0600) for the
node's fronts: during a database outage, whether this node may go on serving
on its last view of the cluster.

A node that cannot reach the database cannot tell from the database whether
it alone is cut off (then the others take it for unreachable and its work is
theirs) or the database is down for everyone (then nobody takes anything, and
refusing would stop the whole cluster). Its links tell: it reaches most of
its peers, and none of those it reaches says it reaches the database (their
PONGs say; platform/node_link/protocol.py), so the outage is everyone's.
"""

import json
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The supervisor writes the file every round of its links (1 s): one older than this
# is not the supervisor's word now (it stopped, or its beat is stuck).
MAX_AGE_S = 6.0
# The file is a few numbers; anything longer is not this file.
MAX_BYTES = 4096


class PeersReached(BaseModel):
    """One heartbeat's reckoning of the peers (the other nodes its last view
    showed serving)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float = Field(description="time.monotonic() of this host when written")
    peers: int = Field(ge=0, description="other serving nodes of the last view")
    reached: int = Field(ge=0, description="of those, the ones linked to now")
    database: int = Field(
        ge=0, description="of those linked to, the ones that reach the database"
    )

    def everyone_cut_off(self) -> bool:
        """Whether the database is down for everyone this node can tell of:
        it reaches most of its peers (or has none) and none of those says it
        reaches the database."""
        most = self.peers == 0 or 2 * self.reached > self.peers
        return most and self.database == 0

    def fresh(self) -> bool:
        return 0 <= time.monotonic() - self.at <= MAX_AGE_S


def peers_file(run_dir: Path | str) -> Path:
    return Path(run_dir) / "peers.json"


def peers_reached_write(run_dir: Path | str, reached: PeersReached) -> None:
    """Written whole, then moved into place (readers never see half)."""
    path = peers_file(run_dir)
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(reached.model_dump_json())
    os.replace(partial, path)


def peers_reached_read(run_dir: Path | str) -> PeersReached | None:
    """The supervisor's last reckoning, or None (no file, a bad one, or one
    too large to be it)."""
    try:
        with open(peers_file(run_dir), "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES:
        return None
    try:
        return PeersReached.model_validate(json.loads(data))
    except (ValueError, ValidationError, RecursionError):  # nested past json's limit
        return None


def serving_through_outage(run_dir: Path | str) -> bool:
    """Whether this host's supervisor, lately, found the database down for
    everyone it reaches (a front may then serve on its last view)."""
    reached = peers_reached_read(run_dir)
    return reached is not None and reached.fresh() and reached.everyone_cut_off()
