"""An engine's port spoken to in raw bytes, below the client: what the tests of
its handshake and its bounds send."""

import socket

from engines.wire.framing import decode_message, recv_frame


def raw_exchange(port: int, data: bytes, *, timeout: float = 5) -> dict:
    """Send raw bytes, return the one reply message."""
    with socket.create_connection(("127.0.0.1", port), timeout) as sock:
        sock.sendall(data)
        return decode_message(recv_frame(sock))
