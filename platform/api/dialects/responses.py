"""OpenAI's Responses API (`/v1/responses`), a translation at the edge onto
the one pipeline: a request's input items (and, with `previous_response_id`,
the stored conversation they continue) become a chat completion request
(api.schemas.ChatCompletionRequest), which runs the steps /v1/chat/completions
runs (api.views.serve: key, body, model, limits, routing with prompt-cache
affinity, the engine, one usage row under the endpoint "responses"); its
answer comes back as a Response object, or streamed as the Responses API's
semantic events. A stored answer (`store`, true by default) is its key's
alone: another key reading, deleting or chaining onto it gets a 404.

Streams hold the call until their last byte; a caller that hangs up cancels
the engine's request (api.calls.StreamBody), as every stream does."""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from ..answers import generation_answer
from ..calls import Call, spawn
from ..choices import call_requests, choices_open
from ..errors import NOT_FOUND, ApiCode, ApiError, from_mapping, invalid_request
from ..models import ApiKey
from ..pipeline import api_error, keyed_request
from ..schemas import ChatCompletionRequest, parse_object
from ..selectors import in_db_thread
from ..sse import dropped_header, streaming_response, streams_closed
from ..token_relay import Ended, Token, tokens_relayed
from ..views import serve
from . import responses_protocol as protocol
from .responses_store import (
    MAX_STORED_BYTES,
    stored_response_delete,
    stored_response_get,
    stored_response_save,
    stored_size,
)

log = logging.getLogger("roundhouse.api")

ENDPOINT = "responses"
# A page of a stored response's input items: OpenAI's default and cap.
ITEMS_PAGE = 20
MAX_ITEMS_PAGE = 100


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request, translated ----------------------------------------------------------


@dataclass
class ResponseTurn:
    """A Responses request translated onto chat: the chat request that runs,
    and what the answer and its stored record are made of."""

    request: protocol.ResponsesRequest
    chat: ChatCompletionRequest
    # The input items as stored and listed (each with its id): the chain's
    # earlier turns' inputs and outputs, then this turn's.
    input_items: list[dict[str, Any]]
    # The chain's messages before this answer, without the instructions
    # (which OpenAI does not carry over to the next turn).
    conversation: list[dict[str, Any]]
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def weight(self) -> int:
        return 1


def previous_not_found(response_id: str) -> ApiError:
    return from_mapping(
        NOT_FOUND,
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code=ApiCode.PREVIOUS_RESPONSE_NOT_FOUND,
    )


def response_not_found(response_id: str) -> ApiError:
    return from_mapping(
        NOT_FOUND,
        f"Response with id '{response_id}' not found.",
        code=ApiCode.RESPONSE_NOT_FOUND,
    )


async def turn_prepared(call: Call, payload: protocol.ResponsesRequest) -> ResponseTurn:
    """The request translated, after the conversation it continues (the
    call's own stored response; a 404 for any other) was read."""
    history: list[dict[str, Any]] = []
    earlier: list[dict[str, Any]] = []
    previous = payload.previous_response_id
    if previous is not None:
        stored = await in_db_thread(stored_response_get)(
            key=call.key, user=call.user, response_id=previous
        )
        if stored is None:
            raise previous_not_found(previous)
        history = stored.conversation
        earlier = [*stored.input_items, *stored.body.get("output", ())]
    return turn_translated(payload, history, earlier)


def turn_translated(
    payload: protocol.ResponsesRequest,
    history: list[dict[str, Any]],
    earlier_items: Sequence[dict[str, Any]] = (),
) -> ResponseTurn:
    """The chat request for this turn: the instructions (a system message),
    the earlier turns' messages, then this input's. Its input items, as
    OpenAI lists a chained response's, are `earlier_items` (the previous
    response's input items and output) and then this input's."""
    items = payload.input
    if isinstance(items, str):
        items = [protocol.ResponseMessageItem(role="user", content=items)]
    known_calls = {
        tool_call["id"]
        for message in history
        for tool_call in message.get("tool_calls") or ()
    }
    conversation = [*history, *_input_messages(items, known_calls)]
    messages = list(conversation)
    if payload.instructions is not None:
        messages.insert(0, {"role": "system", "content": payload.instructions})
    input_items = [*earlier_items, *(_stored_item(item) for item in items)]
    if payload.store and stored_size(input_items, conversation) > MAX_STORED_BYTES:
        raise invalid_request(
            f"This turn's conversation is over the {MAX_STORED_BYTES} bytes a "
            "stored response may hold: send store=false, or start a new chain.",
            param="store",
        )
    chat = parse_object(ChatCompletionRequest, _chat_body(payload, messages))
    return ResponseTurn(
        request=payload, chat=chat, input_items=input_items, conversation=conversation
    )


def _input_messages(items: list[Any], known_calls: set[str]) -> list[dict[str, Any]]:
    """Input items as chat messages: a message as it is, function calls as an
    assistant message's tool calls (consecutive ones together), a call's
    output as a tool message (400 for the output of no call made)."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if isinstance(item, protocol.ResponseMessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, protocol.FunctionCallItem):
            tool_call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            known_calls.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(tool_call)
                if not last["content"]:
                    last["content"] = None
            else:
                messages.append(
                    {"role": "assistant", "content": None, "tool_calls": [tool_call]}
                )
        else:
            if item.call_id not in known_calls:
                raise invalid_request(
                    "No tool call found for function call output with call_id "
                    f"{item.call_id}.",
                    param=f"input.{index}.call_id",
                )
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
            )
    return messages


def _stored_item(item: Any) -> dict[str, Any]:
    """An input item as GET /v1/responses/{id}/input_items lists it: with an
    id, a message's content as parts."""
    fields = item.model_dump(mode="json", exclude_none=True, by_alias=True)
    fields["status"] = "completed"
    if isinstance(item, protocol.ResponseMessageItem):
        fields.setdefault("id", _new_id("msg"))
        if isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            fields["content"] = [{"type": kind, "text": item.content}]
    elif isinstance(item, protocol.FunctionCallItem):
        fields.setdefault("id", _new_id("fc"))
    else:
        fields.setdefault("id", _new_id("fco"))
    return fields


def _chat_body(
    payload: protocol.ResponsesRequest, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat completion request's body for these messages."""
    body: dict[str, Any] = {"model": payload.model, "messages": messages}
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        value = getattr(payload, name)
        if value is not None:
            body[name] = value
    if payload.max_output_tokens is not None:
        body["max_completion_tokens"] = payload.max_output_tokens
    if payload.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": tool.model_dump(exclude_none=True, exclude={"type"}),
            }
            for tool in payload.tools
        ]
    choice = payload.tool_choice
    if isinstance(choice, protocol.FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = payload.text.format if payload.text else None
    if isinstance(fmt, protocol.TextFormatJsonSchema):
        schema = fmt.model_dump(exclude_none=True, by_alias=True, exclude={"type"})
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return body


# -- the answer --------------------------------------------------------------------


@dataclass
class Answered:
    """What an answer said: its text, its calls (call id, name, arguments),
    and whether it stopped at max_output_tokens."""

    text: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    cut_short: bool = False

    def message(self) -> dict[str, Any]:
        """The answer as the chat message a next turn continues from."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.text if (self.text or not self.calls) else None,
        }
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for call_id, name, arguments in self.calls
            ]
        return message


def _usage(call: Call) -> protocol.ResponseUsage:
    return protocol.ResponseUsage(
        input_tokens=call.prompt_tokens,
        input_tokens_details=protocol.ResponseInputTokensDetails(
            cached_tokens=call.cached_tokens,
            cache_write_tokens=max(0, call.prompt_tokens - call.cached_tokens),
        ),
        output_tokens=call.completion_tokens,
        output_tokens_details=protocol.ResponseOutputTokensDetails(),
        total_tokens=call.prompt_tokens + call.completion_tokens,
    )


def response_body(
    turn: ResponseTurn,
    *,
    status: str,
    output: list[Any],
    call: Call | None = None,
    error: ApiError | None = None,
    incomplete_reason: str = "max_output_tokens",
) -> dict[str, Any]:
    """The Response object of this turn (`call`: its usage, once counted;
    `incomplete_reason`: why an incomplete one stopped)."""
    request = turn.request
    fmt = request.text.format if request.text else None
    choice = request.tool_choice
    ended = status in ("completed", "incomplete", "failed")
    body = protocol.Response(
        id=turn.id,
        created_at=turn.created_at,
        completed_at=int(time.time()) if status == "completed" else None,
        status=status,
        error=(
            protocol.ResponseError(code=error.code or error.type, message=error.message)
            if error is not None
            else None
        ),
        incomplete_details=(
            protocol.ResponseIncompleteDetails(reason=incomplete_reason)
            if status == "incomplete"
            else None
        ),
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        metadata=request.metadata or {},
        model=request.model,
        output=output,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        store=request.store,
        temperature=request.temperature,
        text=protocol.ResponseTextConfig(
            format=(
                fmt.model_dump(mode="json", exclude_none=True, by_alias=True)
                if fmt is not None
                else {"type": "text"}
            )
        ),
        tool_choice=(
            choice.model_dump(mode="json")
            if isinstance(choice, protocol.FunctionChoice)
            else choice or "auto"
        ),
        tools=[
            tool.model_dump(mode="json", exclude_none=True)
            for tool in request.tools or ()
        ],
        top_p=request.top_p,
        usage=_usage(call) if call is not None and ended else None,
        user=request.user,
    )
    return body.model_dump(mode="json")


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return protocol.ResponseOutputMessage(
        id=item_id, status=status, content=[protocol.ResponseOutputText(text=text)]
    ).model_dump(mode="json")


def _call_item(
    *, id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return protocol.ResponseFunctionCall(
        id=id, call_id=call_id, name=name, arguments=arguments, status=status
    ).model_dump(mode="json")


async def _stored(call: Call, turn: ResponseTurn, body: dict, answered: Answered):
    """Keep the answer, if the request asked to (its `store`)."""
    if not turn.request.store:
        return
    await in_db_thread(stored_response_save)(
        key=call.key,
        user=call.user,
        body=body,
        input_items=turn.input_items,
        conversation=[*turn.conversation, answered.message()],
    )


async def _stored_after_all(
    call: Call, turn: ResponseTurn, body: dict, answered: Answered
) -> None:
    """Keep an answer that did not end well (failed, or its caller gone), as
    `_stored`: a failure to store it is logged, never raised over the
    failure the caller is being told."""
    try:
        await _stored(call, turn, body, answered)
    except Exception:
        log.exception("could not store the %s response %s", body["status"], turn.id)


async def _answer(call: Call, turn: ResponseTurn) -> HttpResponse:
    if turn.request.stream:
        return await _stream(call, turn)
    chat, reply = await generation_answer(call, turn.chat, chat=True)
    choice = chat["choices"][0]
    message = choice["message"]
    answered = Answered(
        text=message.get("content") or "",
        calls=[
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or ()
        ],
        cut_short=choice["finish_reason"] == "length",
    )
    item_status = "incomplete" if answered.cut_short else "completed"
    output = []
    if answered.text or not answered.calls:
        output.append(_message_item(_new_id("msg"), answered.text, item_status))
    for call_id, name, arguments in answered.calls:
        output.append(
            _call_item(
                id=_new_id("fc"),
                call_id=call_id,
                name=name,
                arguments=arguments,
                status="completed",
            )
        )
    body = response_body(turn, status=item_status, output=output, call=call)
    await _stored(call, turn, body, answered)
    response = JsonResponse(body)
    dropped_header(response, reply)
    return response


# -- the stream --------------------------------------------------------------------


class _Events:
    """The stream's events, numbered in order (`sequence_number`)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        text = json.dumps(data, separators=(",", ":"))
        return f"event: {kind}\ndata: {text}\n\n".encode()


class _Output:
    """The answer's output items as its tokens come: an open message takes
    text, an open function call its arguments; each event as OpenAI orders
    them (an item added, its content, the item done)."""

    def __init__(self, event: _Events) -> None:
        self.event = event
        self.items: list[dict[str, Any]] = []
        self.answered = Answered()
        self._message: tuple[str, list[str]] | None = None  # id, text pieces
        self._call: dict[str, Any] | None = None  # the open call's fields

    def text(self, delta: str) -> bytes:
        out = self._close_call("completed")
        if self._message is None:
            out += self._open_message()
        item_id, pieces = self._message
        pieces.append(delta)
        return out + self.event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=len(self.items),
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def _open_message(self) -> bytes:
        item_id = _new_id("msg")
        self._message = (item_id, [])
        added = {"id": item_id, "type": "message", "role": "assistant"}
        return self.event(
            "response.output_item.added",
            output_index=len(self.items),
            item={**added, "status": "in_progress", "content": []},
        ) + self.event(
            "response.content_part.added",
            item_id=item_id,
            output_index=len(self.items),
            content_index=0,
            part=protocol.ResponseOutputText(text="").model_dump(mode="json"),
        )

    def call_delta(self, call_id: str | None, name: str | None, delta: str) -> bytes:
        out = b""
        if call_id is not None:  # a new call
            out += self._close_message("completed") + self._close_call("completed")
            self._call = {
                "id": _new_id("fc"),
                "call_id": call_id,
                "name": name or "",
                "arguments": "",
            }
            out += self.event(
                "response.output_item.added",
                output_index=len(self.items),
                item=_call_item(**self._call, status="in_progress"),
            )
        if self._call is None or not delta:
            return out
        self._call["arguments"] += delta
        return out + self.event(
            "response.function_call_arguments.delta",
            item_id=self._call["id"],
            output_index=len(self.items),
            delta=delta,
        )

    def cut_off(self) -> bytes:
        """The answer stopped before its end (its engine failed, or its
        caller went away): the open item closed as incomplete, keeping what
        it had."""
        self.answered.cut_short = True
        return self._close_message("incomplete") + self._close_call("incomplete")

    def ended(self, *, cut_short: bool) -> bytes:
        status = "incomplete" if cut_short else "completed"
        self.answered.cut_short = cut_short
        out = b""
        if not self.items and self._message is None and self._call is None:
            out = self._open_message()  # an empty answer: an empty message
        return out + self._close_message(status) + self._close_call(status)

    def _close_message(self, status: str) -> bytes:
        if self._message is None:
            return b""
        item_id, pieces = self._message
        self._message = None
        text = "".join(pieces)
        self.answered.text += text
        index = len(self.items)
        item = _message_item(item_id, text, status)
        self.items.append(item)
        part = item["content"][0]
        return (
            self.event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            + self.event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            )
            + self.event("response.output_item.done", output_index=index, item=item)
        )

    def _close_call(self, status: str) -> bytes:
        if self._call is None:
            return b""
        fields, self._call = self._call, None
        index = len(self.items)
        item = _call_item(**fields, status=status)
        self.items.append(item)
        self.answered.calls.append(
            (fields["call_id"], fields["name"], fields["arguments"])
        )
        return self.event(
            "response.function_call_arguments.done",
            item_id=fields["id"],
            output_index=index,
            name=fields["name"],
            arguments=fields["arguments"],
        ) + self.event("response.output_item.done", output_index=index, item=item)


async def _stream(call: Call, turn: ResponseTurn) -> StreamingHttpResponse:
    """The streamed answer; its headers leave once the engine took the
    request (a refusal before that is the answer's error status). Stored (with
    `store`) however it ends: completed or incomplete as answered; failed, with
    its error and what was said before it, when its engine fails mid-stream
    (the events `error` then `response.failed`); incomplete, reason
    `client_disconnected`, when its caller goes away (stored in the
    background: nothing is left to wait for it)."""
    requests = call_requests(turn.chat, "interactive", call=call)
    opened, usage_count = await choices_open(call, requests, per_prompt=1)

    async def content() -> AsyncIterator[bytes]:
        event = _Events()
        output = _Output(event)
        started = response_body(turn, status="in_progress", output=[])
        yield event("response.created", response=started) + event(
            "response.in_progress", response=started
        )
        relay = tokens_relayed(call, opened, usage_count)
        kept = False  # stored (or being stored) already: never twice
        try:
            async for relayed in relay:
                if isinstance(relayed, Token):
                    frame, out = relayed.frame, b""
                    if frame.text:
                        out += output.text(frame.text)
                    for delta in frame.tool_calls or ():
                        out += output.call_delta(delta.id, delta.name, delta.arguments)
                    if out:
                        yield out
                elif isinstance(relayed, Ended):
                    cut_short = relayed.reason == "length"
                    out = output.ended(cut_short=cut_short)
                    status = "incomplete" if cut_short else "completed"
                    body = response_body(
                        turn, status=status, output=output.items, call=call
                    )
                    kept = True
                    await _stored(call, turn, body, output.answered)
                    kind = f"response.{status}"
                    yield out + event(kind, response=body)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away (api.calls.StreamBody): no event can reach
            # it, and this task may not wait; what was said is kept.
            if not kept:
                output.cut_off()
                gone = response_body(
                    turn,
                    status="incomplete",
                    output=output.items,
                    call=call,
                    incomplete_reason="client_disconnected",
                )
                spawn(
                    _stored_after_all(call, turn, gone, output.answered),
                    "storing a response whose caller went away",
                )
            raise
        except Exception as failure:
            # Headers are sent: the failure travels as events.
            error = api_error(failure, what="a streamed response")
            call.failed_with(error)
            out = output.cut_off()
            failed = response_body(
                turn, status="failed", output=output.items, call=call, error=error
            )
            if not kept:
                await _stored_after_all(call, turn, failed, output.answered)
            yield (
                out
                + event(
                    "error",
                    code=error.code or error.type,
                    message=error.message,
                    param=error.param,
                )
                + event("response.failed", response=failed)
            )
        finally:
            await streams_closed(relay, opened)

    return streaming_response(content(), opened[0][1])


# -- the views ---------------------------------------------------------------------


@csrf_exempt
async def create(request: HttpRequest) -> HttpResponse:
    """POST /v1/responses."""
    return await serve(
        request, ENDPOINT, protocol.ResponsesRequest, _answer, prepare=turn_prepared
    )


async def _stored_of(key: ApiKey, response_id: str):
    stored = await in_db_thread(stored_response_get)(key=key, response_id=response_id)
    if stored is None:
        raise response_not_found(response_id)
    return stored


@csrf_exempt
async def response(request: HttpRequest, response_id: str) -> HttpResponse:
    """GET and DELETE /v1/responses/{response_id}: the key's own only."""

    async def read(request: HttpRequest, key: ApiKey) -> HttpResponse:
        return JsonResponse((await _stored_of(key, response_id)).body)

    async def delete(request: HttpRequest, key: ApiKey) -> HttpResponse:
        deleted = await in_db_thread(stored_response_delete)(
            key=key, response_id=response_id
        )
        if not deleted:
            raise response_not_found(response_id)
        body = protocol.ResponseDeleted(id=response_id)
        return JsonResponse(body.model_dump(mode="json"))

    return await keyed_request(request, {"GET": read, "DELETE": delete})


async def input_items(request: HttpRequest, response_id: str) -> HttpResponse:
    """GET /v1/responses/{response_id}/input_items: a page of the items the
    response answered (`limit`, `order` (desc by default, as OpenAI's),
    `after`): with `previous_response_id`, the whole chain's, as OpenAI
    lists them (every earlier turn's input and output, then this turn's)."""

    async def listed(request: HttpRequest, key: ApiKey) -> HttpResponse:
        limit_text = request.GET.get("limit", str(ITEMS_PAGE))
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_ITEMS_PAGE:
            raise invalid_request(
                f"Invalid 'limit': an integer from 1 to {MAX_ITEMS_PAGE}.",
                param="limit",
            )
        order = request.GET.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_request("Invalid 'order': 'asc' or 'desc'.", param="order")
        items = list((await _stored_of(key, response_id)).input_items)
        if order == "desc":
            items.reverse()
        after = request.GET.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise invalid_request(
                    f"No input item with id '{after}' in this response.",
                    param="after",
                )
            items = items[ids.index(after) + 1 :]
        page = items[: int(limit_text)]
        body = protocol.InputItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > len(page),
        )
        return JsonResponse(body.model_dump(mode="json"))

    return await keyed_request(request, {"GET": listed})
