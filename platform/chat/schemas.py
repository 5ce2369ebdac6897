"""The WebSocket chat's client messages, typed; unknown keys are refused.

A `chat` message carries the same fields as a `/v1/chat/completions` body: its
`model` and `messages`, and the sampling fields in `params`, checked by the REST
schema itself (`chat_request`), so both paths accept and refuse the same
things with the same messages.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from api import errors
from api.schema_base import ModelName, Name, Strict
from api.schemas import ChatCompletionRequest, parse_object

# The fields a chat's `params` may set: those of /v1/chat/completions that
# shape the answer (not how it is delivered: `stream`, `stream_options`).
PARAMS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "n",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
StreamId = Annotated[str, Field(min_length=1, max_length=64)]
# A client's id for one turn (what it asks, and its answer), kept when the
# turn is sent again (after a reconnect, or a retry): the server stores a turn
# once per conversation and id (chat.services.conversation_turn_record).
TurnId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class Auth(Strict):
    """`{"type": "auth", "key": "rh-..."}`: the first message of a socket
    without a logged-in session."""

    type: Literal["auth"]
    key: Annotated[Name, Field(max_length=256)]


class Chat(Strict):
    """Start a stream: one answer to `messages` from `model`."""

    type: Literal["chat"]
    id: StreamId
    model: ModelName
    # Checked by ChatCompletionRequest (chat_request).
    messages: list[Any]
    params: dict[str, Any] = Field(default_factory=dict)
    # Store the turn in this conversation (one of the caller's); none: start
    # a new one. `regenerate`: the answer replaces the conversation's last
    # one, and no new user message is stored.
    conversation: Annotated[int, Field(ge=1)] | None = None
    regenerate: bool = False
    # Optional: the same id on a turn sent again replaces its stored answer
    # instead of adding the turn a second time.
    turn_id: TurnId | None = None


class Cancel(Strict):
    """Stop a stream; its `done` says `cancelled`."""

    type: Literal["cancel"]
    id: StreamId


# The message classes by `type`.
CLIENT_MESSAGES: dict[str, type[Auth | Chat | Cancel]] = {
    "auth": Auth,
    "chat": Chat,
    "cancel": Cancel,
}


def client_message(text: str) -> Auth | Chat | Cancel:
    """A client's message; a 400 ApiError (`bad_request`) saying what is
    wrong otherwise (for its fields, as REST says it: api.schemas)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise errors.invalid_request("The message is not valid JSON.") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise errors.invalid_request(
            "A message is a JSON object with a `type`: auth, chat or cancel."
        )
    kind = CLIENT_MESSAGES.get(data["type"])
    if kind is None:
        raise errors.invalid_request(
            f"Unknown message type '{data['type'][:40]}': use auth, chat or cancel."
        )
    return parse_object(kind, data)


def chat_request(chat: Chat) -> ChatCompletionRequest:
    """The chat as the REST body it stands for (a stream); its 400 otherwise."""
    unknown = sorted(set(chat.params) - PARAMS)
    if unknown:
        raise errors.invalid_request(
            f"Unrecognized params argument supplied: {unknown[0]}",
            param=f"params.{unknown[0]}",
        )
    body = {**chat.params, "model": chat.model, "messages": chat.messages}
    return parse_object(ChatCompletionRequest, {**body, "stream": True})
