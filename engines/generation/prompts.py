"""A request's prompt text: its `prompt`, or its `messages` through the
model's chat template, with the tools it offers (rendered by the template
where it knows tools, else described in a system message:
engines/constrained/toolcalls.py)."""

from dataclasses import dataclass
from typing import Any

from engines.constrained.toolcalls import (
    template_knows_tools,
    template_messages,
    tool_schema,
    tools_instructions,
)
from engines.generation.templates import render_chat, validate_messages
from engines.wire.bounds import MAX_PROMPT_CHARS
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.requests import Function


@dataclass(frozen=True)
class OfferedTools:
    """A request's tools as its prompt offers them, made once per request
    (a chat whose oldest turns are dropped is rendered several times):
    their schemas for a template that renders tools, else the system text
    that describes them."""

    schemas: list[dict[str, Any]]
    instructions: str = ""


def offered_tools(message: dict[str, Any], *, template: str) -> OfferedTools:
    """The tools a request offers, as the model's template takes them."""
    tools = _functions(message)
    if not tools:
        return OfferedTools([])
    if template_knows_tools(template):
        return OfferedTools([tool_schema(tool) for tool in tools])
    parallel = message.get("parallel_tool_calls", True)
    return OfferedTools([], tools_instructions(tools, parallel=parallel))


def render_prompt(
    message: dict[str, Any],
    *,
    template: str,
    bos_text: str,
    eos_text: str,
    tools: OfferedTools | None = None,
) -> str:
    """The prompt text of a generate request (its `tools`, when made
    already: offered_tools); bad_request when the model cannot serve it (a
    chat without a chat template)."""
    if "messages" in message:
        if not template:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "this model has no chat template: send a completion prompt, or "
                "set a chat template for it in the admin",
            )
        messages = validate_messages(message["messages"])
        knows_tools = template_knows_tools(template)
        messages = template_messages(messages, knows_tools=knows_tools)
        if tools is None:
            tools = offered_tools(message, template=template)
        text = tools.instructions
        if text:
            if messages[0]["role"] == "system":
                first = messages[0]["content"]
                messages[0] = {"role": "system", "content": f"{first}\n\n{text}"}
            else:
                messages.insert(0, {"role": "system", "content": text})
        return render_chat(
            template,
            messages,
            bos_token=bos_text,
            eos_token=eos_text,
            tools=tools.schemas or None,
            # Only `tokenize` may leave it out: a generation opens the turn.
            add_generation_prompt=message.get("add_generation_prompt", True),
        )
    prompt = message.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "send `prompt` (a string) or `messages`"
        )
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the prompt exceeds the cap")
    return prompt


def _functions(message: dict[str, Any]) -> list[Function]:
    """The tools a request offers the model (none when its choice is none)."""
    if message.get("tool_choice") == "none":
        return []
    return [
        tool if isinstance(tool, Function) else Function.model_validate(tool)
        for tool in message.get("tools") or ()
    ]
