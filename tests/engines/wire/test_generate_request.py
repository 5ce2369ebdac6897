"""The engine's typed generate request bounds what it will render and compile:
the offered tools together, and the whole request, are refused as
bad_request over their caps, before anything is rendered; at a cap, taken."""

import pytest

from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.requests import (
    MAX_REQUEST_BYTES,
    MAX_TOOLS_CHARS,
    parse_request,
    request_bytes,
    tools_chars,
)

CHAT = {
    "kind": "generate",
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
}


def tools_of_size(total: int, count: int = 8) -> list[dict]:
    """`count` tools of `total` characters together, as tools_chars counts."""
    tools = [
        {"name": f"tool_{i}", "description": "", "parameters": {"type": "object"}}
        for i in range(count)
    ]
    spare = total - tools_chars(tools)
    for i, tool in enumerate(tools):
        tool["description"] = "d" * (spare // count + (i < spare % count))
    assert tools_chars(tools) == total
    return tools


def refused(message: dict, **kwargs) -> str:
    with pytest.raises(ProtocolError) as error:
        parse_request(message, **kwargs)
    assert error.value.code == ErrorCode.BAD_REQUEST
    return error.value.message


def test_tools_over_their_total_cap_are_refused():
    """Tools each within their caps, over MAX_TOOLS_CHARS together: refused
    naming `tools`; at the cap, taken (the control)."""
    message = refused({**CHAT, "tools": tools_of_size(MAX_TOOLS_CHARS + 1)})
    assert message.startswith("tools:") and str(MAX_TOOLS_CHARS) in message
    typed = parse_request({**CHAT, "tools": tools_of_size(MAX_TOOLS_CHARS)})
    assert len(typed.tools) == 8


def with_size(size: int) -> dict:
    """A chat request of `size` bytes (request_bytes) in its prompt."""
    short = request_bytes({**CHAT, "messages": [{"role": "user", "content": ""}]})
    turn = {"role": "user", "content": "x" * (size - short)}
    message = {**CHAT, "messages": [turn]}
    assert request_bytes(message) == size
    return message


def test_a_request_over_the_whole_cap_is_refused():
    """A request over MAX_REQUEST_BYTES, as measured or as the frame that
    brought it says, is refused; at the cap, taken (the control)."""
    message = refused(with_size(MAX_REQUEST_BYTES + 1))
    assert f"over the cap of {MAX_REQUEST_BYTES}" in message
    assert refused(CHAT, size=MAX_REQUEST_BYTES + 1)
    assert parse_request(with_size(MAX_REQUEST_BYTES))
    assert parse_request(CHAT, size=MAX_REQUEST_BYTES)
