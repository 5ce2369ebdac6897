"""Tool calls in chat: how offered tools and past calls reach the prompt, and
how the model's answer is read back into calls.

One format, the one Qwen2.5, Hermes and SmolLM3 are trained on: a call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A chat
template that knows tools (it reads `tools`) renders them and the history
itself; for one that does not, the tools are described in a system message
that asks for that format, past calls become that text in the assistant's
turn and tool results become user turns in `<tool_response>` blocks. The
answer's grammar (engines/constrained/grammar.py) holds a call to this format and to
the offered tools' schemas, so a call read back here is well formed.

Pure Python: no ML library."""

import json
import re
import uuid
from typing import Any

from engines.wire.requests import Function

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
# A call's opening as the grammar writes it: its name, then its arguments.
# Matched once the arguments' first character is in.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)'
)


def template_knows_tools(template: str) -> bool:
    """Whether a chat template renders `tools` itself."""
    return "tools" in template


def tool_schema(tool: Function) -> dict[str, Any]:
    """A tool as chat templates expect it (OpenAI's `tools` entries)."""
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def tools_instructions(tools: list[Function], *, parallel: bool) -> str:
    """The system text that offers tools to a model whose template does not."""
    listed = "\n".join(json.dumps(tool_schema(tool)) for tool in tools)
    how = (
        "You may call one or more functions to answer."
        if parallel
        else "You may call one function to answer."
    )
    return (
        f"# Tools\n\n{how} The functions you can call are:\n{listed}\n\n"
        f"To call a function, answer with its name and arguments as JSON "
        f"inside {TOOL_OPEN}{TOOL_CLOSE} tags:\n"
        f'{TOOL_OPEN}\n{{"name": <function-name>, "arguments": <args-object>}}\n'
        f"{TOOL_CLOSE}"
    )


def call_text(name: str, arguments: str) -> str:
    """A past call as the model writes one."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    body = json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False)
    return f"{TOOL_OPEN}\n{body}\n{TOOL_CLOSE}"


def template_messages(
    messages: list[dict[str, Any]], *, knows_tools: bool
) -> list[dict[str, Any]]:
    """The history as the template gets it. A template that knows tools gets
    the calls with their arguments parsed (as Hugging Face templates read
    them); one that does not gets them as text, and tool results as user
    turns (consecutive ones merged: many templates insist that turns
    alternate)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls") or []
        if knows_tools:
            item = {"role": message["role"], "content": message.get("content") or ""}
            if calls:
                item["tool_calls"] = [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {
                            "name": call["function"]["name"],
                            "arguments": _parsed(call["function"]["arguments"]),
                        },
                    }
                    for call in calls
                ]
            if message.get("tool_call_id"):
                item["tool_call_id"] = message["tool_call_id"]
            if message.get("name"):
                item["name"] = message["name"]
            out.append(item)
            continue
        if message["role"] == "tool":
            block = f"{RESPONSE_OPEN}\n{message.get('content') or ''}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("from_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "from_tool": True})
            continue
        content = message.get("content") or ""
        if calls:
            texts = [
                call_text(call["function"]["name"], call["function"]["arguments"])
                for call in calls
            ]
            content = "\n".join(([content] if content else []) + texts)
        out.append({"role": message["role"], "content": content})
    for item in out:
        item.pop("from_tool", None)
    return out


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ToolCallStream:
    """Splits a slot's answer into content and tool calls as it streams: text
    outside `<tool_call>` blocks is content; a block is a call, whose id and
    name go out once its name is read and whose arguments follow in pieces
    (OpenAI's deltas). `calls` holds the complete calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        self._buffer = ""
        self._state = "text"  # text | head | arguments | tail
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Take new text; the content to send now and the call deltas."""
        self._buffer += text
        content, deltas = "", []
        while True:
            moved, out = self._advance(deltas)
            content += out
            if not moved:
                return content, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the answer: what was held back. A call cut short (the
        answer hit its length) is left as it stands."""
        deltas: list[dict[str, Any]] = []
        content = ""
        if self._state == "text":
            content, self._buffer = self._buffer, ""
            if self.calls and not content.strip():
                content = ""  # the space between or after calls
        elif self._state == "arguments" and self._buffer:
            self._send_arguments(self._buffer, deltas)
            self._buffer = ""
        return content, deltas

    def _advance(self, deltas: list) -> tuple[bool, str]:
        """One move of the parser; whether it moved, and content to send."""
        buffer = self._buffer
        if self._state == "text":
            at = buffer.find(TOOL_OPEN)
            if at >= 0:
                self._buffer = buffer[at + len(TOOL_OPEN) :]
                self._state = "head"
                before = buffer[:at]
                return True, before if before.strip() else ""
            keep = _partial_suffix(buffer, TOOL_OPEN)
            out = buffer[: len(buffer) - keep]
            if self.calls and not out.strip():
                return False, ""  # held: the space between calls is no content
            self._buffer = buffer[len(buffer) - keep :]
            return False, out
        if self._state == "head":
            match = _HEAD.match(buffer)
            if match is None:
                return False, ""
            name = json.loads(f'"{match.group(1)}"')
            self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name})
            self.calls[-1]["arguments"] = ""
            deltas.append(
                {
                    "index": len(self.calls) - 1,
                    "id": self.calls[-1]["id"],
                    "name": name,
                    "arguments": "",
                }
            )
            self._buffer = buffer[match.end() :]
            self._state, self._depth = "arguments", 0
            self._in_string = self._escaped = False
            return True, ""
        if self._state == "arguments":
            end = self._value_end(buffer)
            if end is None:
                self._send_arguments(buffer, deltas)
                self._buffer = ""
                return False, ""
            self._send_arguments(buffer[:end], deltas)
            self._buffer = buffer[end:]
            self._state = "tail"
            return True, ""
        # tail: the call's closing brace and tag
        at = buffer.find(TOOL_CLOSE)
        if at < 0:
            return False, ""
        self._buffer = buffer[at + len(TOOL_CLOSE) :].lstrip("\n")
        self._state = "text"
        return True, ""

    def _value_end(self, text: str) -> int | None:
        """Where the arguments' JSON value ends in `text` (scanning on from
        the state left by earlier text), or None if it goes on."""
        for index, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return index + 1
        return None

    def _send_arguments(self, text: str, deltas: list) -> None:
        if not text:
            return
        self.calls[-1]["arguments"] += text
        index = len(self.calls) - 1
        if deltas and deltas[-1]["index"] == index:
            deltas[-1]["arguments"] += text
        else:
            deltas.append({"index": index, "arguments": text})


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
