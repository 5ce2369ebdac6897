"""Requests to an engine, typed: one model per kind (ping, state, load,
unload, embed, rerank, tokenize, detokenize, generate / generate_stream,
cancel, configure, shutdown), every
field a caller may send (unknown keys refused, each field's shape). The
engine parses each request once, with `parse_request`, into its model
(engines/runtime/server.py); its clients send built models
(engines/wire/client.py), the front's generate requests built from its REST
schemas (api.schemas), so both sides read one schema. The replies:
engines/wire/replies.py.

Sampling values (temperature, max_tokens, stop, ...) are bounded by
engines.wire.bounds.check_sampling, the bounds the admin and the REST schemas
use too; texts by check_text. No ML library here: the front imports this."""

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
)

from engines.launch.config import LiveConfig
from engines.wire.bounds import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_TEXTS_PER_REQUEST,
    check_text,
)
from engines.wire.errors import ErrorCode, ProtocolError, bad_request
from engines.wire.framing import frame_bytes

# A generation's priority: interactive (a person or an app waiting on it) or
# batch (a Batch API line). Batch requests are admitted after interactive ones,
# leave slots free for them, and sit out a pass while an interactive prompt is
# being read (engines/generation/runner.py, engines/generation/slot_pool.py).
PRIORITIES = ("interactive", "batch")
# How long a model may stay idle after a request (Ollama's `keep_alive`, in
# seconds; engines/runtime/residency.py): None, the model's own keep-alive;
# below 0, no limit; 0, unloaded once idle. Bounded at a year: a larger
# number is the same as none.
MAX_KEEP_ALIVE_S = 366 * 24 * 3600.0
KeepAlive = Annotated[float, Field(ge=-1, le=MAX_KEEP_ALIVE_S, allow_inf_nan=False)]

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
    """A request or a part of one: unknown keys refused, values fixed once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def encoded(self) -> bytes:
        """The request as one frame, its None fields left out."""
        return frame_bytes(self.model_dump_json(exclude_none=True).encode("utf-8"))


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

    # Set by the client that sends it: whole answer, or a stream of frames.
    kind: Literal["generate", "generate_stream"] = "generate"
    model: str
    request_id: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    priority: Priority | None = None
    # Who asked, as the front's limits know them (an opaque id): a model's
    # free slots go first to the callers with the fewest requests in slots.
    caller: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    # Whose prompt cache the request may read and fill (an opaque id, vLLM's
    # `cache_salt`): a slot's cached prefix is reused, or copied, only for a
    # request with the same salt. None: the cache shared by every request
    # without one.
    cache_salt: Annotated[str, Field(min_length=1, max_length=64)] | None = None
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
    keep_alive_s: KeepAlive | None = None

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


class PingRequest(Wire):
    """Is the engine up, and is it still loading its models."""

    kind: Literal["ping"] = "ping"


class StateRequest(Wire):
    """What the supervisor records (frames.StateReply)."""

    kind: Literal["state"] = "state"


class LoadRequest(Wire):
    """Load a model now (Ollama's empty prompt: its `keep_alive_s` then says
    how long it may stay idle)."""

    kind: Literal["load"] = "load"
    model: str
    keep_alive_s: KeepAlive | None = None


class UnloadRequest(Wire):
    """Unload once the model's requests in flight have drained; with
    `when_idle` (Ollama's keep_alive 0), as its keep-alive would: once it is
    idle, not if it is kept until its memory is needed, and a model not
    resident is no error."""

    kind: Literal["unload"] = "unload"
    model: str
    when_idle: bool = False


class EmbedRequest(Wire):
    """Texts to embed; the rows come back as JSON or as a `.npy` frame."""

    kind: Literal["embed"] = "embed"
    model: str
    texts: list[str]
    encoding: Literal["json", "npy"] = "npy"
    keep_alive_s: KeepAlive | None = None


class RerankRequest(Wire):
    """Documents scored against a query, in their order: by a cross-encoder
    (a `rerank` model), or by an embedder's cosine similarity."""

    kind: Literal["rerank"] = "rerank"
    model: str
    query: str
    documents: list[str]


class TokenizeRequest(Wire):
    """A prompt's tokens as a generation evaluates them: `prompt` as it is,
    or `messages` (and the tools they are offered) through the model's chat
    template, rendered as a generation renders them
    (engines/generation/prompts.py)."""

    kind: Literal["tokenize"] = "tokenize"
    model: str
    prompt: str | None = None
    messages: Annotated[list[Turn], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[Function], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal[TOOL_CHOICES] | NamedTool | None = None  # type: ignore[valid-type]
    parallel_tool_calls: bool = True
    # The template's opening of the assistant's turn, as generation adds it.
    add_generation_prompt: bool = True


class DetokenizeRequest(Wire):
    """The text of token ids (special tokens left out, as answers are)."""

    kind: Literal["detokenize"] = "detokenize"
    model: str
    tokens: Annotated[
        list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKENS)
    ]


class CancelRequest(Wire):
    """Cancel a generation, by its request id, from another connection."""

    kind: Literal["cancel"] = "cancel"
    request_id: str


class ConfigureRequest(Wire):
    """Change the settings a running engine may change without a restart."""

    kind: Literal["configure"] = "configure"
    # What changes, typed (unknown keys and mistyped values refused when the
    # request is read, before the engine applies any of it).
    config: LiveConfig


class ShutdownRequest(Wire):
    """Drain, then stop."""

    kind: Literal["shutdown"] = "shutdown"


Request = Annotated[
    PingRequest
    | StateRequest
    | LoadRequest
    | UnloadRequest
    | EmbedRequest
    | RerankRequest
    | TokenizeRequest
    | DetokenizeRequest
    | GenerateRequest
    | CancelRequest
    | ConfigureRequest
    | ShutdownRequest,
    Field(discriminator="kind"),
]
REQUEST = TypeAdapter(Request)
KINDS = (
    "ping",
    "state",
    "load",
    "unload",
    "embed",
    "rerank",
    "tokenize",
    "detokenize",
    "generate",
    "generate_stream",
    "cancel",
    "configure",
    "shutdown",
)
# pydantic's error types for a value of the wrong JSON type.
_WRONG_TYPES = frozenset(
    {
        "string_type",
        "int_type",
        "int_from_float",
        "float_type",
        "bool_type",
        "list_type",
        "dict_type",
        "model_type",
        "model_attributes_type",
    }
)


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


def parse_request(message: dict[str, Any], *, size: int | None = None) -> Request:
    """A request, typed: the one check an engine makes of what arrives,
    after authentication; bad_request naming the first bad field otherwise
    (an unknown one included). `size`: a generate request's bytes as they
    arrived (its frame's payload), else measured here."""
    kind = message.get("kind")
    if kind is None:
        raise bad_request("missing field 'kind'")
    if not isinstance(kind, str):
        raise bad_request("field 'kind' has the wrong type")
    if kind not in KINDS:
        raise bad_request(f"unknown kind {kind!r}")
    # A prompt to render (tokenize's too) is held to a generation's size.
    if kind in ("generate", "generate_stream", "tokenize"):
        size = request_bytes(message) if size is None else size
        if size > MAX_REQUEST_BYTES:
            raise bad_request(
                f"the request is {size} bytes, over the cap of {MAX_REQUEST_BYTES}"
            )
    try:
        request = REQUEST.validate_python(message)
    except ValidationError as error:
        raise _refusal(error) from None
    if isinstance(request, GenerateRequest):
        _check_generate(request)
    elif isinstance(request, EmbedRequest):
        _check_texts(request.texts)
    elif isinstance(request, RerankRequest):
        _check_texts([request.query], what="query")
        _check_texts(request.documents, what="documents")
    elif isinstance(request, TokenizeRequest):
        _check_tokenize(request)
    return request


def _refusal(error: ValidationError) -> ProtocolError:
    """The bad_request for a request its model refused, naming the first bad
    field (the kind, which pydantic puts first, left out)."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"][1:])
    if first["type"] == "extra_forbidden":
        return bad_request(f"{where}: unknown field")
    if first["type"] == "missing":
        return bad_request(f"missing field {where!r}")
    if first["type"] in _WRONG_TYPES:
        return bad_request(f"field {where!r} has the wrong type")
    return bad_request(f"{where}: {first['msg']}")


def _check_generate(request: GenerateRequest) -> None:
    sources = (request.prompt, request.messages, request.prompt_tokens)
    if sum(source is not None for source in sources) != 1:
        raise bad_request(
            "send exactly one of `prompt`, `messages` and `prompt_tokens`"
        )
    if request.prompt is not None:
        check_text(request.prompt, "prompt")
    _check_sizes(request)


def _check_tokenize(request: "TokenizeRequest") -> None:
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("send exactly one of `prompt` and `messages`")
    if request.prompt is not None:
        check_text(request.prompt, "prompt")
    elif not request.messages:
        raise bad_request("messages is empty")
    _check_sizes(request)


def _check_texts(texts: list[str], *, what: str = "texts") -> None:
    if not texts:
        raise bad_request(f"{what} is empty")
    if len(texts) > MAX_TEXTS_PER_REQUEST:
        raise bad_request(
            f"{len(texts)} {what} exceed the cap of {MAX_TEXTS_PER_REQUEST}"
        )
    for index, text in enumerate(texts):
        check_text(text, f"{what}[{index}]")
        if len(text) > MAX_PROMPT_CHARS:
            raise bad_request(
                f"a text of {len(text)} characters exceeds the cap of "
                f"{MAX_PROMPT_CHARS}"
            )


def _check_sizes(request: "GenerateRequest | TokenizeRequest") -> None:
    """Schemas are compiled into grammars: each is bounded, and tools and a
    response format are not asked for together."""
    schemas = []
    if getattr(request, "response_format", None) is not None:
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
