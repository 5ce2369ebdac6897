"""Anthropic's Messages onto the chat pipeline, and back: a body becomes the
chat request (api.schemas.ChatCompletionRequest) every transport runs; an
engine's answer becomes a message, its usage Anthropic's, any failure
Anthropic's error object with Anthropic's type for its status.

A message's blocks become chat turns: text blocks one turn's text (joined by a
blank line), `tool_use` blocks the assistant turn's tool calls (their `input`
as the call's JSON arguments), and each `tool_result` block a `tool` turn
answering its call, before the user's own text. The system prompt is the
first turn; thinking blocks are dropped.
"""

import json
from typing import Annotated, Any

from django.http import HttpResponse
from pydantic import Field

from engines.wire.bounds import MAX_TOP_K
from engines.wire.errors import ErrorCode
from engines.wire.replies import CalledTool, Ending

from ... import errors
from ...calls import Call
from ...schemas import ChatCompletionRequest, parse_object
from .protocol import (
    AnthropicContentBlock,
    AnthropicErrorDetail,
    AnthropicErrorResponse,
    AnthropicInput,
    AnthropicMessagesRequest,
    AnthropicTextBlock,
    AnthropicTextBlockIn,
    AnthropicThinkingBlockIn,
    AnthropicToolResultBlockIn,
    AnthropicToolUseBlock,
    AnthropicToolUseBlockIn,
    AnthropicUnreadableBlock,
    AnthropicUsage,
    StopReason,
)

# Text blocks of one turn are joined by this.
BLOCK_SEPARATOR = "\n\n"
# Anthropic's tool_choice types as the chat request's.
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class AnthropicChat(ChatCompletionRequest):
    """A chat request with Anthropic's `top_k` (the engines sample with it;
    OpenAI's chat has no such field)."""

    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None

    def engine_fields(self) -> dict[str, Any]:
        fields = super().engine_fields()
        if self.top_k is not None:
            fields["top_k"] = self.top_k
        return fields


def chat_request(body: AnthropicInput) -> AnthropicChat:
    """The chat request a Messages body makes, checked by the chat's own
    rules (its caps, its tools); a 400 naming what Roundhouse cannot serve."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _joined(body.system)})
    for index, message in enumerate(body.messages):
        messages.extend(_turns(message.role, message.content, f"messages.{index}"))
    if body.messages[-1].role == "assistant":
        # Continuing a partial assistant turn needs the engine to render the
        # chat template without closing that turn (Hugging Face's
        # continue_final_message); the engines' templating always opens a
        # new one (engines/generation/prompts.py), so the prefill would be
        # answered, not continued: refused rather than silently wrong.
        raise errors.invalid_request(
            "A last assistant message (a prefill for the model to continue) is "
            "not supported: Roundhouse's engines always start a new assistant "
            "turn and cannot continue a partial one. End with a user message "
            "(and ask there for the answer's opening, or use stop_sequences or "
            "output_config.format to shape it).",
            param="messages",
        )
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None and (body.tools or choice.type == "none"):
        if choice.type == "tool":
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": choice.name},
            }
        else:
            fields["tool_choice"] = TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use is not None and body.tools:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    elif choice is not None:
        raise errors.invalid_request(
            f"tool_choice {choice.type!r} needs `tools`.", param="tool_choice"
        )
    output = body.output_config
    if output is not None and output.format is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output.format.schema_},
        }
    if isinstance(body, AnthropicMessagesRequest):
        fields["max_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
    return parse_object(AnthropicChat, fields)


def _joined(content: str | list[AnthropicTextBlockIn]) -> str:
    if isinstance(content, str):
        return content
    return BLOCK_SEPARATOR.join(block.text for block in content)


def _turns(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """The chat turns of one message."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        if isinstance(block, AnthropicUnreadableBlock):
            raise _unreadable(block, f"{where}.content.{index}")
        if isinstance(block, AnthropicTextBlockIn):
            texts.append(block.text)
        elif isinstance(block, AnthropicToolUseBlockIn):
            if role != "assistant":
                raise errors.invalid_request(
                    "tool_use blocks belong in assistant messages.",
                    param=f"{where}.content.{index}",
                )
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, AnthropicToolResultBlockIn):
            if role != "user":
                raise errors.invalid_request(
                    "tool_result blocks belong in user messages.",
                    param=f"{where}.content.{index}",
                )
            results.append(_tool_turn(block, f"{where}.content.{index}"))
        elif isinstance(block, AnthropicThinkingBlockIn):
            continue  # an earlier turn's thinking: not part of the prompt
    turns = list(results)
    if calls:
        turns.append(
            {
                "role": "assistant",
                "content": BLOCK_SEPARATOR.join(texts) or None,
                "tool_calls": calls,
            }
        )
    elif texts or not results:
        turns.append({"role": role, "content": BLOCK_SEPARATOR.join(texts)})
    return turns


def _tool_turn(block: AnthropicToolResultBlockIn, where: str) -> dict[str, Any]:
    """A tool result as the chat's `tool` turn (an error's text marked so)."""
    content = block.content
    if isinstance(content, list):
        for index, part in enumerate(content):
            if isinstance(part, AnthropicUnreadableBlock):
                raise _unreadable(part, f"{where}.content.{index}")
        text = _joined([p for p in content if isinstance(p, AnthropicTextBlockIn)])
    else:
        text = content or ""
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _unreadable(block: AnthropicUnreadableBlock, where: str) -> errors.ApiError:
    return errors.invalid_request(
        f"{block.type} blocks are not supported: Roundhouse's models read text, "
        "tool calls and tool results.",
        param=where,
    )


# -- answers --------------------------------------------------------------------


def stop_reason(ending: Ending) -> StopReason:
    """Anthropic's stop reason for how the engine's answer ended."""
    if ending.finish_reason == "tool_calls":
        return "tool_use"
    if ending.finish_reason == "length":
        return "max_tokens"
    if ending.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage(call: Call) -> AnthropicUsage:
    """The call's tokens as Anthropic counts them: the prompt's evaluated
    ones, and apart those the prompt cache held."""
    return AnthropicUsage(
        input_tokens=call.prompt_tokens - call.cached_tokens,
        output_tokens=call.completion_tokens,
        cache_read_input_tokens=call.cached_tokens,
    )


def tool_use(called: CalledTool) -> AnthropicToolUseBlock:
    """A call the answer made, its JSON arguments as `input`."""
    return AnthropicToolUseBlock(
        id=called.id, name=called.name, input=tool_input(called.arguments)
    )


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (the engine holds them to the tool's
    schema, an object; anything else is kept whole under `arguments`)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def content_blocks(text: str, calls: list[CalledTool]) -> list[AnthropicContentBlock]:
    """A whole answer's content: its text (left out if blank beside tool
    calls), then its tool calls."""
    blocks: list[AnthropicContentBlock] = []
    if text.strip() or not calls:
        blocks.append(AnthropicTextBlock(text=text))
    blocks.extend(tool_use(called) for called in calls)
    return blocks


# -- errors -----------------------------------------------------------------------

# Anthropic's error type for each status the pipeline answers (others: api_error).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# An engine's queue full is Anthropic's "overloaded" (its status 529), not a
# caller over its limits.
OVERLOADED = 529


def anthropic_error(error: errors.ApiError) -> tuple[int, AnthropicErrorResponse]:
    """The status and Anthropic's error body for an API error."""
    status = OVERLOADED if error.code == ErrorCode.OVERLOADED else error.status
    detail = AnthropicErrorDetail(
        type=ERROR_TYPES.get(status, "api_error"), message=error.message
    )
    return status, AnthropicErrorResponse(error=detail)


def error_response(error: errors.ApiError) -> HttpResponse:
    """An API error as Anthropic answers one (Retry-After kept)."""
    status, body = anthropic_error(error)
    response = HttpResponse(
        body.model_dump_json(), status=status, content_type="application/json"
    )
    if error.retry_after_s is not None:
        response["Retry-After"] = str(error.retry_after_s)
    return response
