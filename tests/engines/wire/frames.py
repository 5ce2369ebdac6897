"""Frames read back from bytes, for the tests that look at what travels: a
buffer split into its frames' payloads, checked as the engines' readers check
them (engines/wire/framing.py read_frame, recv_frame)."""

from collections.abc import Iterator

from engines.wire.bounds import MAX_FRAME_BYTES
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.framing import HEADER, frame_length


def split_frames(data: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> Iterator[bytes]:
    """Payloads of the complete frames in a buffer; a partial tail is an error."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < HEADER.size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "truncated header")
        size = frame_length(data[offset : offset + HEADER.size], max_bytes=max_bytes)
        offset += HEADER.size
        if len(data) - offset < size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "truncated frame")
        yield data[offset : offset + size]
        offset += size
