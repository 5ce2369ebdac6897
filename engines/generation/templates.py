"""Backend-independent parts of text generation: sampling parameters, chat
templates, and the stream of text a slot hands back (UTF-8 reassembly and stop
strings). Pure Python: no ML library."""

import json
from functools import lru_cache
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engines.wire.bounds import MAX_MESSAGES, MAX_PROMPT_CHARS, check_text
from engines.wire.errors import bad_request


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Chat messages: a non-empty list of {"role": str, "content": str}; an
    assistant turn may carry `tool_calls` instead of content, a tool turn its
    `tool_call_id` (their shape is checked by engines.wire.requests)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"at most {MAX_MESSAGES} messages")
    total = 0
    out = []
    for index, item in enumerate(messages):
        if not isinstance(item, dict):
            raise bad_request("each message must be an object")
        role, content = item.get("role"), item.get("content")
        calls = item.get("tool_calls") or []
        if content is None and calls:
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise bad_request("each message needs a string role and content")
        check_text(role, f"messages[{index}].role")
        check_text(content, f"messages[{index}].content")
        total += len(content)
        turn: dict[str, Any] = {"role": role, "content": content}
        if calls:
            turn["tool_calls"] = [
                call.model_dump() if hasattr(call, "model_dump") else call
                for call in calls
            ]
            for number, call in enumerate(turn["tool_calls"]):
                arguments = call["function"]["arguments"]
                check_text(arguments, f"messages[{index}].tool_calls[{number}]")
                total += len(arguments)
        for key in ("tool_call_id", "name"):
            if item.get(key):
                turn[key] = check_text(item[key], f"messages[{index}].{key}")
        out.append(turn)
    if total > MAX_PROMPT_CHARS:
        raise bad_request(f"messages exceed the cap of {MAX_PROMPT_CHARS} characters")
    return out


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    """Chat templates' `tojson` as Hugging Face renders it (Jinja's own
    escapes <, > and & for HTML, which a prompt must not get)."""
    return json.dumps(
        value,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        ensure_ascii=ensure_ascii,
    )


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Apply a model's Jinja chat template (sandboxed) for a new assistant
    turn (without its opening: `add_generation_prompt` false), with the tools
    offered where the template renders them."""
    try:
        return _compiled(template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as error:
        raise bad_request(f"chat template failed: {error}") from None


@lru_cache(maxsize=16)
def _compiled(template: str):
    """A chat template compiled once, on the engine's event loop then only
    the render (SmolLM2's: about 3 ms to compile, 0.1 ms to render a
    conversation); the last few templates kept, an engine's models' own."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(template)
