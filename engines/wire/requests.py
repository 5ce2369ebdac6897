"""Requests to an engine: the kinds, their shape, and the typed `generate` /
`generate_stream` request: every field a caller may
send, checked when it arrives (unknown keys refused, each field's shape). The
engine checks each request with it (engines/runtime/server.py) and the
front builds its requests with it (api.answers), so both sides read one schema.

Sampling values (temperature, max_tokens, stop, ...) are bounded by
engines.wire.framing.check_sampling, the bounds the admin and the REST schemas
use too; texts by check_text. No ML library here: the front imports this."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from engines.wire.bounds import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_TEXTS_PER_REQUEST,
    check_text,
)
from engines.wire.errors import ErrorCode, ProtocolError

# A generation's priority: interactive (a person or an app waiting on it) or
# batch (a Batch API line). Batch requests are admitted after interactive ones,
# leave slots free for them, and sit out a pass while an interactive prompt is
# being read (engines/generation/runner.py, engines/generation/slots.py).
PRIORITIES = ("interactive", "batch")

KINDS = (
    "ping",
    "state",
    "load",
    "unload",
    "embed",
    "generate",
    "generate_stream",
    "cancel",
    "configure",
    "shutdown",
)

# Tools a request may offer, and the serialized size of a JSON schema (a
# response format's, or one tool's parameters): grammars are compiled from
# them, so they are bounded before any work is done.
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 64 * 1024
# Prompt token ids a request may send instead of text.
MAX_PROMPT_TOKENS = 256 * 1024
# The offered tools together (`tools_chars`: each tool's name, description and
# parameters as JSON): they are rendered into the prompt of every choice and
# compiled into one grammar. 128 tools of 64 KiB schemas and 256 Ki-character
# descriptions would be ~40 MiB; 256 Ki characters is ~64k tokens, more than
# most models' whole context, and 60 tools of 4 KiB each (a large MCP server's
# set) are under a quarter of it.
MAX_TOOLS_CHARS = 256 * 1024
# A whole generate request as it travels (`request_bytes`: its compact UTF-8
# JSON). The largest the per-field caps mean to allow alone is
# under 2 MiB (MAX_PROMPT_TOKENS ids of 6 digits, or a MAX_PROMPT_CHARS
# prompt with escapes, plus the tools); their sum is not (1024 turns with
# 256 Ki-character tool-call arguments), and no context holds that.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# What the front's pipeline adds to the fields a request body gives (kind,
# model, request_id, priority): the front holds those fields to
# MAX_REQUEST_BYTES less this, so that what it passes the engine takes.
ENVELOPE_BYTES = 1024
# OpenAI's rule for function names.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
TOOL_CHOICES = ("auto", "none", "required")

Priority = Literal[PRIORITIES]  # type: ignore[valid-type]
Schema = dict[str, JsonValue]


class Wire(BaseModel):
    """A part of a request: unknown keys refused, values fixed once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionCall(Wire):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    # A JSON object, as text (OpenAI's shape).
    arguments: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ToolCall(Wire):
    """A call an assistant turn made (in the history of a chat)."""

    id: Annotated[str, Field(min_length=1, max_length=200)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Turn(Wire):
    """One chat message. `content` may be null only on an assistant turn that
    calls tools; a `tool` turn answers the call named by `tool_call_id`."""

    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Annotated[str, Field(max_length=200)] | None = None
    name: Annotated[str, Field(max_length=200)] | None = None


class Function(Wire):
    """A tool the model may call: a function and its parameters' JSON schema."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] = ""
    parameters: Schema = Field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    strict: bool | None = None


class NamedTool(Wire):
    """`tool_choice` naming the one function the model must call."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]


class ResponseFormat(Wire):
    """The answer's shape: free text, any JSON object, or JSON matching a
    schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Schema | None = None


class GenerateRequest(Wire):
    """A generation: one of `prompt`, `messages` or `prompt_tokens`, the
    sampling fields (bounded by check_sampling), and the constraints on the
    answer (a response format, or tools to call)."""

    kind: Literal["generate", "generate_stream"]
    model: str
    request_id: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    priority: Priority | None = None
    # Who asked, as the front's limits know them (an opaque id): a model's
    # free slots go first to the callers with the fewest requests in slots.
    caller: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    prompt: str | None = None
    messages: Annotated[list[Turn], Field(max_length=MAX_MESSAGES)] | None = None
    prompt_tokens: (
        Annotated[
            list[Annotated[int, Field(ge=0)]],
            Field(min_length=1, max_length=MAX_PROMPT_TOKENS),
        ]
        | None
    ) = None
    # Sampling: checked (bounds, types, messages) by check_sampling.
    temperature: JsonValue = None
    top_p: JsonValue = None
    top_k: JsonValue = None
    min_p: JsonValue = None
    repeat_penalty: JsonValue = None
    presence_penalty: JsonValue = None
    frequency_penalty: JsonValue = None
    seed: JsonValue = None
    max_tokens: JsonValue = None
    stop: JsonValue = None
    ignore_eos: JsonValue = None
    logprobs: JsonValue = None
    top_logprobs: JsonValue = None
    # The answer's shape: at most one of a response format and tools.
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Function], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal[TOOL_CHOICES] | NamedTool | None = None  # type: ignore[valid-type]
    parallel_tool_calls: bool = True
    # Send the prompt's text back with the answer (completions' `echo`).
    echo: bool = False

    @property
    def offers_tools(self) -> bool:
        """Whether the model is offered tools (a choice of `none` offers none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        """Whether the answer is held to a grammar: JSON, or calls of the
        offered tools (engines/constrained/grammar.py)."""
        fmt = self.response_format
        return (fmt is not None and fmt.type != "text") or self.offers_tools


def tools_chars(tools: list[dict[str, Any]]) -> int:
    """The size of offered tools as MAX_TOOLS_CHARS counts it: the JSON
    (`json.dumps`' defaults) of each tool's name, description and parameters."""
    return sum(
        len(
            json.dumps(
                [
                    tool.get("name"),
                    tool.get("description") or "",
                    tool.get("parameters"),
                ]
            )
        )
        for tool in tools
    )


def request_bytes(fields: dict[str, Any]) -> int:
    """The size of a generate request as MAX_REQUEST_BYTES counts it: its
    compact UTF-8 JSON, as a frame carries it."""
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False)
    return len(text.encode("utf-8", "surrogatepass"))


def check_generate(
    message: dict[str, Any], *, size: int | None = None
) -> GenerateRequest:
    """A generate request's fields, typed; bad_request naming the first bad
    field otherwise (an unknown one included). `size`: the request's bytes as
    they arrived (its frame's payload), else measured here."""
    size = request_bytes(message) if size is None else size
    if size > MAX_REQUEST_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"the request is {size} bytes, over the cap of {MAX_REQUEST_BYTES}",
        )
    sources = sum(message.get(key) is not None for key in ("prompt", "messages"))
    sources += message.get("prompt_tokens") is not None
    if sources != 1:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            "send exactly one of `prompt`, `messages` and `prompt_tokens`",
        )
    try:
        request = GenerateRequest.model_validate(message)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        if first["type"] == "extra_forbidden":
            reason = "unknown field"
        else:
            reason = first["msg"]
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: {reason}") from None
    _check_sizes(request)
    return request


def _check_sizes(request: GenerateRequest) -> None:
    """Schemas are compiled into grammars: each is bounded, and tools and a
    response format are not asked for together."""
    schemas = []
    if request.response_format is not None:
        kind = request.response_format.type
        schema = request.response_format.json_schema
        if kind == "json_schema" and schema is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "response_format: json_schema needs a schema"
            )
        if schema is not None:
            schemas.append(("response_format.json_schema", schema))
        if request.tools and kind != "text":
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "send tools or a JSON response format, not both",
            )
    for index, tool in enumerate(request.tools or ()):
        schemas.append((f"tools[{index}].parameters", tool.parameters))
    if request.tools:
        size = tools_chars([tool.model_dump() for tool in request.tools])
        if size > MAX_TOOLS_CHARS:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"tools: {size} characters together, over the cap of {MAX_TOOLS_CHARS}",
            )
    for where, schema in schemas:
        if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{where} exceeds {MAX_SCHEMA_CHARS} characters",
            )
    names = [tool.name for tool in request.tools or ()]
    if len(set(names)) != len(names):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "tools: two share a name")
    choice = request.tool_choice
    if isinstance(choice, NamedTool) and choice.name not in names:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"tool_choice names {choice.name!r}, which is not among the tools",
        )
    if choice == "required" and not names:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "tool_choice is required but no tools are offered"
        )


def _require(message: dict, key: str, kind: type | tuple, *, optional: bool = False):
    if key not in message:
        if optional:
            return None
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"missing field {key!r}")
    value = message[key]
    if isinstance(value, bool) and kind is not bool:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {key!r} has the wrong type")
    if not isinstance(value, kind):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {key!r} has the wrong type")
    return value


def validate_request(message: dict[str, Any]) -> str:
    """Check a request's shape after authentication; returns its kind (a
    generate request's fields are checked by engines.wire.requests)."""
    kind = _require(message, "kind", str)
    if kind not in KINDS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown kind {kind!r}")
    if kind in ("load", "unload", "embed", "generate", "generate_stream"):
        _require(message, "model", str)
    if kind in ("generate", "generate_stream"):
        # The rest of a generate request's shape: engines.wire.requests.
        prompt = _require(message, "prompt", str, optional=True)
        if prompt is not None:
            check_text(prompt, "prompt")
    if kind == "cancel":
        _require(message, "request_id", str)
    if kind == "embed":
        texts = _require(message, "texts", list)
        if not texts:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "texts is empty")
        if len(texts) > MAX_TEXTS_PER_REQUEST:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{len(texts)} texts exceed the cap of {MAX_TEXTS_PER_REQUEST}",
            )
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "texts must be strings")
            check_text(text, f"texts[{index}]")
            if len(text) > MAX_PROMPT_CHARS:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"a text of {len(text)} characters exceeds the cap of "
                    f"{MAX_PROMPT_CHARS}",
                )
        encoding = _require(message, "encoding", str, optional=True)
        if encoding not in (None, "json", "npy"):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "encoding is json or npy")
    if kind == "configure":
        _require(message, "config", dict)
    return kind
