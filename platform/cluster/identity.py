"""A node's identity on its own host: its name and secret in the run dir
(mode 0600), read by the supervisor, the front and the workers of that host;
and the one hash used for join tokens and node secrets."""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path


def secret_hash(secret: str) -> str:
    """The SHA-256 (hex) under which a join token or node secret is stored."""
    return hashlib.sha256(secret.encode("utf-8", errors="replace")).hexdigest()


@dataclass(frozen=True)
class NodeIdentity:
    """Who this host is in the cluster, and the secret that proves it."""

    name: str
    secret: str

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"NodeIdentity(name={self.name!r})"


def identity_file(run_dir: Path | str) -> Path:
    return Path(run_dir) / "node.json"


def identity_write(run_dir: Path | str, identity: NodeIdentity) -> Path:
    """Keep the identity readable by this user only (written whole, then
    moved into place)."""
    path = identity_file(run_dir)
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"node": identity.name, "secret": identity.secret}, handle)
    os.replace(partial, path)
    return path


def identity_stamp(run_dir: Path | str) -> tuple[int, int] | None:
    """What changes when the identity file is written again (it is replaced,
    a new inode): its inode and modification time; None without one."""
    try:
        status = identity_file(run_dir).stat()
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns


def identity_read(run_dir: Path | str) -> NodeIdentity | None:
    """This host's identity, or None on a host that has not joined a cluster."""
    try:
        data = json.loads(identity_file(run_dir).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return NodeIdentity(name=str(data["node"]), secret=str(data["secret"]))
