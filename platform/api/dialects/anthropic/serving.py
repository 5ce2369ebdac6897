"""A Messages answer, whole or streamed, made by the chat pipeline's own steps
(api.answers.generation_answer; api.choices and api.token_relay for a
stream, as api.sse uses them) and told in Anthropic's shapes.

A stream is Anthropic's events: `message_start` (the prompt's tokens known),
a `ping`, each content block as `content_block_start`, its deltas
(`text_delta`, or a tool call's arguments as `input_json_delta`) and
`content_block_stop`, then `message_delta` (the stop reason and the final
usage) and `message_stop`. An engine failing mid-stream is an `error` event.
"""

from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from engines.wire.client import EngineError

from ...answers import generation_answer
from ...calls import Call
from ...choices import call_requests, choices_open
from ...pipeline import engine_failure
from ...sse import dropped_header, streaming_response, streams_closed
from ...token_relay import Ended, Token, tokens_relayed
from .protocol import (
    AnthropicContentBlockDelta,
    AnthropicContentBlockStart,
    AnthropicContentBlockStop,
    AnthropicInputJsonDelta,
    AnthropicMessage,
    AnthropicMessageDelta,
    AnthropicMessageDeltaFields,
    AnthropicMessageStart,
    AnthropicMessageStop,
    AnthropicPing,
    AnthropicTextBlock,
    AnthropicTextDelta,
    AnthropicToolUseBlock,
    AnthropicUsage,
)
from .translation import (
    AnthropicChat,
    anthropic_error,
    content_blocks,
    stop_reason,
    usage,
)


async def message_answer(call: Call, chat: AnthropicChat) -> HttpResponse:
    """The whole message (api.answers.generation_answer makes it)."""
    _, reply = await generation_answer(call, chat, chat=True)
    message = AnthropicMessage(
        id="msg_" + reply.request_id,
        content=content_blocks(reply.text, reply.tool_calls or []),
        model=call.model,
        stop_reason=stop_reason(reply),
        stop_sequence=reply.stop_sequence,
        usage=usage(call),
    )
    response = JsonResponse(message.model_dump(mode="json"))
    dropped_header(response, reply)
    return response


def event(body: Any) -> bytes:
    """One server-sent event (a body of protocol.STREAM_EVENTS), named by its
    `type`."""
    return f"event: {body.type}\ndata: {body.model_dump_json()}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed message, numbered as they open: a
    text block, or one per tool call; the open one is closed when another
    opens, and at the end."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text", or the open tool call's index
        self.calls: dict[int, int] = {}  # a tool call's index: its block's

    def _start(self, block, key: str) -> list[bytes]:
        out = self.close()
        self.open = key
        out.append(
            event(AnthropicContentBlockStart(index=self.count, content_block=block))
        )
        self.count += 1
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event(AnthropicContentBlockStop(index=self.count - 1))]

    def text(self, text: str) -> list[bytes]:
        out = (
            []
            if self.open == "text"
            else self._start(AnthropicTextBlock(text=""), "text")
        )
        delta = AnthropicTextDelta(text=text)
        out.append(event(AnthropicContentBlockDelta(index=self.count - 1, delta=delta)))
        return out

    def tool_call(
        self, index: int, call_id: str | None, name: str | None, arguments: str
    ) -> list[bytes]:
        out: list[bytes] = []
        if call_id is not None:  # a call's first delta names it
            block = AnthropicToolUseBlock(id=call_id, name=name or "", input={})
            out = self._start(block, f"call{index}")
            self.calls[index] = self.count - 1
        if arguments and index in self.calls:
            delta = AnthropicInputJsonDelta(partial_json=arguments)
            out.append(
                event(AnthropicContentBlockDelta(index=self.calls[index], delta=delta))
            )
        return out


async def message_stream(call: Call, chat: AnthropicChat) -> StreamingHttpResponse:
    """The streamed message; its headers leave once the engine gave the
    request a slot (a refusal before that is the answer's error status)."""
    requests = call_requests(chat, "interactive", call=call)
    opened, usage_count = await choices_open(call, requests, per_prompt=1)
    start = opened[0][1]
    # Blank text before a tool call is left out, as in a whole answer.
    hold_blanks = bool(requests[0].offers_tools)
    started = AnthropicMessage(
        id="msg_" + start.request_id,
        content=[],
        model=call.model,
        stop_reason=None,
        stop_sequence=None,
        usage=AnthropicUsage(input_tokens=start.prompt_tokens, output_tokens=0),
    )

    async def content() -> AsyncIterator[bytes]:
        blocks = _Blocks()
        held = ""
        yield event(AnthropicMessageStart(message=started)) + event(AnthropicPing())
        relay = tokens_relayed(call, opened, usage_count)
        try:
            async for item in relay:
                out: list[bytes] = []
                if isinstance(item, Token):
                    frame = item.frame
                    text = frame.text
                    if hold_blanks and blocks.open != "text" and not text.strip():
                        held += text
                    elif text:
                        out += blocks.text(held + text)
                        held = ""
                    for delta in frame.tool_calls or ():
                        out += blocks.tool_call(
                            delta.index, delta.id, delta.name, delta.arguments
                        )
                elif isinstance(item, Ended):
                    ending = item.frame
                    if blocks.count == 0:  # an empty answer: one empty text block
                        out += blocks.text(held)
                    out += blocks.close()
                    fields = AnthropicMessageDeltaFields(
                        stop_reason=stop_reason(ending),
                        stop_sequence=ending.stop_sequence,
                    )
                    out.append(
                        event(AnthropicMessageDelta(delta=fields, usage=usage(call)))
                    )
                    out.append(event(AnthropicMessageStop()))
                if out:
                    yield b"".join(out)
        except EngineError as failure:
            # Headers are sent: the failure travels as an error event.
            error = engine_failure(failure)
            call.failed_with(error)
            yield event(anthropic_error(error)[1])
        finally:
            await streams_closed(relay, opened)

    return streaming_response(content(), start)
