"""Node links: how a front reaches an engine on another host.

Engines listen on 127.0.0.1 of their own host. Each host runs a relay (in its
supervisor) on the address the other nodes reach it at. A front opens one
long-lived link to each other node's relay, authenticated by the front's own
node secret (never a caller's API key), optionally in TLS with the relay's
pinned certificate, and carries every request to that node's engines over it:

    front ──link (one TCP/TLS connection per node pair, many streams)──▶ relay
    relay ──127.0.0.1, the engine's token──▶ engine

A stream is one engine connection, byte for byte: the relay opens it to the
engine with the engine's token and copies bytes both ways, so requests,
streamed frames and cancellation by hang-up work exactly as on loopback. The
client side (platform/node_link/client.py) is `RemoteEngineClient`, an
AsyncEngineClient whose `_open` opens a stream instead of a socket: one code
path, only the transport differs. The relay side is platform/node_link/relay.py;
this module holds what both sides speak.

Wire: the link opens with one engine-protocol frame (`LinkHello`, at most
4 KiB, read with a deadline) answered by `{"status": "ok", "node": ...}` or an
error frame. Then link frames: a 9-byte header (stream id u32, type u8,
length u32; payload at most MAX_LINK_PAYLOAD, refused before it is read) and
the payload. OPEN names the engine, DATA carries bytes, CLOSE is a hang-up
(either side), PING/PONG keep the link proven alive: a link that hears nothing
for LINK_DEAD_S is dropped, and every stream on it fails as a dropped
connection does (EngineDied), so a node cut off mid-stream is noticed within
seconds. An engine the relay cannot reach is answered in the stream as an
`unreachable` error frame: the caller tries another replica.
"""

import asyncio
import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from engines.wire.bounds import MAX_TOKEN_CHARS
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.replies import ErrorReply

LINK_HEADER = struct.Struct(">IBI")  # stream id, frame type, payload length
MAX_LINK_PAYLOAD = 1 << 20
OPEN, DATA, CLOSE, PING, PONG = 1, 2, 3, 4, 5
# Stream ids are u32; 0 is the link's own (pings). A client wraps past the
# largest to 1 again, skipping ids still open.
MAX_STREAM_ID = 0xFFFFFFFF
FRAME_TYPES = frozenset({OPEN, DATA, CLOSE, PING, PONG})
# Engine names as the admin allows them (slugs): a stream naming anything else
# is refused before the relay looks for the engine.
ENGINE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# The client pings an idle link this often; a side that hears nothing for
# LINK_DEAD_S (client) or RELAY_DEAD_S (relay: it only answers) drops the link.
LINK_PING_S = 1.0
LINK_DEAD_S = 3.0
RELAY_DEAD_S = 5.0
# A relay's PONG says whether its node reaches the cluster's database now. A
# node that cannot reach the database tells from its links whether it alone is
# cut off (its peers reach the database: their fronts take its work) or the
# database is down for everyone (then it serves on its last view). Empty (a
# relay of an older version): not known, taken for "reaches it".
DATABASE_REACHED, DATABASE_UNREACHED = b"\x01", b"\x00"
# After a link to a node could not be made, requests for it fail at once for
# this long (they go to another replica) instead of each waiting to connect.
CONNECT_COOLDOWN_S = 1.0


class LinkRefused(Exception):
    """The relay refused the link (wrong or revoked secret, a certificate
    not its node's) or is not who it should be."""


class LinkHello(BaseModel):
    """A link's first frame: which node calls, and its secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(pattern="^link$")
    version: int = Field(ge=1, le=1)
    node: str = Field(min_length=1, max_length=64)
    secret: str = Field(min_length=1, max_length=MAX_TOKEN_CHARS)


class LinkWelcome(BaseModel):
    """The relay's answer to a hello it accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Literal["ok"] = "ok"
    node: str = Field(min_length=1, max_length=64)


# The relay's answer to a hello: a welcome, or why not.
WELCOME = TypeAdapter(
    Annotated[LinkWelcome | ErrorReply, Field(discriminator="status")]
)


def link_frame(stream: int, kind: int, payload: bytes = b"") -> bytes:
    return LINK_HEADER.pack(stream, kind, len(payload)) + payload


def data_frames(stream: int, data: bytes) -> bytes:
    """DATA frames carrying `data`, split at the payload cap."""
    view = memoryview(data)
    return b"".join(
        link_frame(stream, DATA, bytes(view[at : at + MAX_LINK_PAYLOAD]))
        for at in range(0, len(data), MAX_LINK_PAYLOAD)
    )


async def read_link_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """The next link frame; ProtocolError for an unknown type or a payload
    over the cap (before reading it), IncompleteReadError at the end."""
    stream, kind, size = LINK_HEADER.unpack(await reader.readexactly(LINK_HEADER.size))
    if kind not in FRAME_TYPES:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown link frame type {kind}")
    if size > MAX_LINK_PAYLOAD:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"link frame of {size} bytes exceeds the {MAX_LINK_PAYLOAD} cap",
        )
    return stream, kind, await reader.readexactly(size) if size else b""


def certificate_fingerprint(der: bytes) -> str:
    """The SHA-256 (hex) by which a relay's certificate is pinned."""
    return hashlib.sha256(der).hexdigest()


@dataclass(frozen=True)
class PrivateCa:
    """Links in mutual TLS under the operator's private CA, instead of pinned
    self-signed certificates: `ca` signs every node's certificate, `cert` and
    `key` are this node's (its name as a DNS subject-alternative name or the
    common name). Both ends present one, both check the other's against the
    CA and the node name it should carry."""

    ca: Path
    cert: Path
    key: Path


def certificate_names(peercert: dict[str, Any] | None) -> set[str]:
    """The names a verified certificate (ssl's getpeercert()) is for: its DNS
    subject-alternative names and common names."""
    if not peercert:
        return set()
    names = {
        value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS"
    }
    for rdn in peercert.get("subject", ()):
        names.update(value for key, value in rdn if key == "commonName")
    return names
