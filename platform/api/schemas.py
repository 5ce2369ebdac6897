"""Typed request bodies of the OpenAI-compatible endpoints, and their parsing
(a 400 naming the first bad field).

The same classes validate requests and produce `/v1/openapi.json`, so the document
always matches what the endpoints accept. Fields OpenAI defines that Roundhouse
does not implement are refused by name (`extra="forbid"`) rather than ignored.
Their building blocks: api.schema_base; tools and response formats:
api.answer_formats.
"""

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engines.wire.bounds import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TEXTS_PER_REQUEST,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    TEMPERATURE_RANGE,
)
from engines.wire.framing import find_lone_surrogate
from engines.wire.requests import (
    ENVELOPE_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_BYTES,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    Function,
    FunctionCall,
    GenerateRequest,
    NamedTool,
    ToolCall,
    Turn,
    request_bytes,
    tools_chars,
)

from .answer_formats import (
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallIn,
    engine_format,
)
from .errors import ApiError
from .schema_base import (
    MaxTokens,
    ModelName,
    Name,
    NoNul,
    Penalty,
    Prompt,
    StopText,
    Strict,
    Temperature,
    Text,
    field_error,
)

# Choices one answer may hold (prompts times n), and texts or token arrays
# one completions request may send.
MAX_CHOICES = 8
MAX_PROMPTS = 8
# Completions' `logprobs`: the likeliest tokens reported beside each (OpenAI's cap).
MAX_COMPLETION_LOGPROBS = 5


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Name | None = None
    # An assistant turn's calls, and the call a tool turn answers.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Annotated[str, Field(max_length=200), NoNul()] | None = None
    # Sent back as the API answered it (the official client returns an
    # assistant message with these set): an empty refusal only.
    refusal: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def engine_message(self) -> Turn:
        """The message as the engine takes it (built from this checked
        message: not checked again)."""
        role = "system" if self.role == "developer" else self.role
        fields: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            fields["tool_calls"] = [
                ToolCall.model_construct(
                    id=call.id,
                    type=call.type,
                    function=FunctionCall.model_construct(
                        name=call.function.name, arguments=call.function.arguments
                    ),
                )
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        return Turn.model_construct(**fields)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields shared by chat and text completions."""

    model: ModelName
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    stop: (
        StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None
    ) = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices per prompt: each runs in its own slot of the same engine batch.
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    user: Name | None = None

    @field_validator("temperature")
    @classmethod
    def _greedy_or_warm(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise PydanticCustomError("temperature", f"must be {TEMPERATURE_RANGE}")
        return value

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling fields (only those the caller set)."""
        fields = ("temperature", "top_p", "seed", "presence_penalty")
        out = {name: getattr(self, name) for name in fields}
        out["frequency_penalty"] = self.frequency_penalty
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return {name: value for name, value in out.items() if value is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def weight(self) -> int:
        """Engine requests the answer opens (prompts times n): what it counts
        against its caller's concurrency (api.limits)."""
        return self.prompt_count * self.choices_per_prompt

    @property
    def prompt_count(self) -> int:
        return 1

    def engine_requests(self, **envelope: Any) -> list[GenerateRequest]:
        """The engine requests that make the answer's choices, in choice
        order, each built once, whole: this checked body's fields (the body
        is the front's one check of them, the engine's the other), the
        prompt's, the choice's own (a fresh request id; a seed moved on by
        one per choice, so that seeded choices differ) and the pipeline's
        `envelope`, the same on every request (priority, caller, cache salt:
        api.choices.call_requests)."""
        shared = {"model": self.model, **self.engine_fields(), **envelope}
        out = []
        for prompt in self.engine_prompts():
            for number in range(self.choices_per_prompt):
                own: dict[str, Any] = {"request_id": uuid.uuid4().hex}
                if self.seed is not None and number:
                    own["seed"] = (self.seed + number) % (MAX_SEED + 1)
                out.append(
                    GenerateRequest.model_construct(**{**shared, **prompt, **own})
                )
        return out

    def engine_prompts(self) -> list[dict[str, Any]]:
        """Each prompt's own engine fields."""
        raise NotImplementedError

    def _within_request_cap(self) -> None:
        """Each engine request this body makes fits the engines' cap on a
        whole request (less the room the pipeline's own fields take); over
        it, the error names the field that holds most of it. Measured on the
        requests `engine_requests` builds, those sent (the envelope aside):
        each prompt's first choice (its others differ only in their own id
        and seed)."""
        limit = MAX_REQUEST_BYTES - ENVELOPE_BYTES
        for request in self.engine_requests()[:: self.choices_per_prompt]:
            fields = body_fields(request)
            size = request_bytes(fields)
            if size > limit:
                largest = max(fields, key=lambda key: request_bytes({key: fields[key]}))
                field = "prompt" if largest == "prompt_tokens" else largest
                raise field_error(
                    field,
                    f"the request is {size} bytes as the engine gets it, over the "
                    f"cap of {limit}",
                )

    def engine_fields(self) -> dict[str, Any]:
        """The engine fields every prompt's requests share (GenerateRequest's)."""
        raise NotImplementedError


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _within_prompt_cap(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if sum(len(message.text()) for message in value) > MAX_PROMPT_CHARS:
            raise PydanticCustomError(
                "too_long", f"messages exceed the cap of {MAX_PROMPT_CHARS} characters"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "needs `logprobs` set to true")
        if self.tool_choice is not None and self.tool_choice != "none":
            if not self.tools:
                raise field_error("tool_choice", "needs `tools`")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise field_error(
                    "tool_choice", "names a function that is not among the tools"
                )
        if self.tools and self.response_format and self.response_format.type != "text":
            raise field_error(
                "response_format", "a JSON answer cannot be asked for with tools"
            )
        if self.tools:
            offered = [tool.model_dump() for tool in self.engine_fields()["tools"]]
            size = tools_chars(offered)
            if size > MAX_TOOLS_CHARS:
                raise field_error(
                    "tools",
                    f"{size} characters together, over the cap of {MAX_TOOLS_CHARS}",
                )
        self._within_request_cap()
        return self

    def engine_prompts(self) -> list[dict[str, Any]]:
        return [{"messages": [m.engine_message() for m in self.messages]}]

    def engine_fields(self) -> dict[str, Any]:
        fields = self.sampling()
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None:
            fields["max_tokens"] = limit
        if self.logprobs:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.top_logprobs or 0
        if self.response_format is not None:
            fields["response_format"] = engine_format(self.response_format)
        if self.tools:
            fields["tools"] = [
                Function.model_construct(
                    name=tool.function.name,
                    description=tool.function.description or "",
                    parameters=tool.function.parameters
                    or {"type": "object", "properties": {}},
                )
                for tool in self.tools
            ]
            choice = self.tool_choice
            if isinstance(choice, NamedToolChoice):
                fields["tool_choice"] = NamedTool.model_construct(
                    name=choice.function.name
                )
            elif choice is not None:
                fields["tool_choice"] = choice
            if self.parallel_tool_calls is not None:
                fields["parallel_tool_calls"] = self.parallel_tool_calls
        return fields


def body_fields(request: GenerateRequest) -> dict[str, Any]:
    """The fields of an engine request that its body gave, as JSON: not the
    envelope (the model, and what the pipeline adds: ENVELOPE_BYTES)."""
    return request.model_dump(mode="json", exclude_unset=True, exclude=ENVELOPE)


# An engine request's fields that no body gives: the model it names, and what
# the pipeline adds (ENVELOPE_BYTES is the room they take).
ENVELOPE = frozenset({"model", "request_id", "priority", "caller", "cache_salt"})


TokenIds = Annotated[
    list[Annotated[int, Field(ge=0)]],
    Field(min_length=1, max_length=MAX_PROMPT_TOKENS),
]


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    # A text, several texts, a token array or several: one answer each (times
    # `n`), in order.
    prompt: (
        Prompt
        | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: MaxTokens | None = 16
    echo: bool = False
    # The number of likeliest tokens to report beside each chosen one.
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    # Not OpenAI's (vLLM's and llama.cpp server's): the answer held to JSON.
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _within_choices(self) -> "CompletionRequest":
        if len(self.prompts()) * self.choices_per_prompt > MAX_CHOICES:
            raise field_error(
                "n", f"prompts times n must be at most {MAX_CHOICES} choices"
            )
        self._within_request_cap()
        return self

    @property
    def prompt_count(self) -> int:
        return len(self.prompts())

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a token array."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def engine_prompts(self) -> list[dict[str, Any]]:
        return [
            {"prompt": p} if isinstance(p, str) else {"prompt_tokens": p}
            for p in self.prompts()
        ]

    def engine_fields(self) -> dict[str, Any]:
        fields = self.sampling()
        if self.max_tokens is not None:
            fields["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.logprobs
        if self.echo:
            fields["echo"] = True
        if self.response_format is not None:
            fields["response_format"] = engine_format(self.response_format)
        return fields


class EmbeddingRequest(Strict):
    """POST /v1/embeddings."""

    model: ModelName
    input: Text | Annotated[list[Text], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: Name | None = None

    @field_validator("input")
    @classmethod
    def _within_cap(cls, value):
        if isinstance(value, list) and len(value) > MAX_TEXTS_PER_REQUEST:
            raise ValueError(
                f"at most {MAX_TEXTS_PER_REQUEST} inputs per request, got {len(value)}"
            )
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    @property
    def weight(self) -> int:
        """One engine request, however many inputs (they are encoded in one
        batch)."""
        return 1


_MISMATCHES = frozenset(
    {
        "string_type",
        "list_type",
        "int_type",
        "int_parsing",
        "float_type",
        "float_parsing",
        "bool_type",
        "bool_parsing",
        "dict_type",
        "model_type",
        "model_attributes_type",
        "none_required",
    }
)


def _is_field(part: str | int) -> bool:
    """Whether a part of an error location names a field or an index, rather
    than a union member (pydantic adds `str`, `list[...]`, `constrained-str`)."""
    if isinstance(part, int):
        return True
    return part.isidentifier() and part not in ("str", "int", "float", "bool", "list")


def parse(schema: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body; a 400 naming the first bad field otherwise."""
    try:
        return schema.model_validate_json(raw)
    except ValidationError as error:
        raise _refusal(error, raw) from None


def parse_object(schema: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON value (the WebSocket chat's messages) by the
    same rules and with the same 400s as `parse`."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise _refusal(error, None) from None


def _refusal(error: ValidationError, raw: bytes | None) -> ApiError:
    """The 400 for a body the schema refused, naming the first bad field."""
    found = error.errors(include_url=False)
    # A union field reports one error per member; the one that is not a
    # plain type mismatch is about the member the caller meant.
    first = next((e for e in found if e["type"] not in _MISMATCHES), found[0])
    location = ".".join(str(part) for part in first["loc"] if _is_field(part))
    if first["type"] == "consistency":
        location = first["ctx"]["field"]
    if first["type"] == "json_invalid" and raw is not None:
        return _invalid_json(raw, first["msg"])
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {location}"
    elif first["type"] == "missing":
        message = f"Missing required parameter: '{location}'."
    else:
        message = f"Invalid value for '{location}': {first['msg']}."
    return ApiError(400, message, param=location or None)


def _invalid_json(raw: bytes, reason: str) -> ApiError:
    """A body pydantic's parser refused. Its parser refuses a lone surrogate
    escape (`\\ud800`) as it refuses bad syntax; Python's reads one, and the
    field that holds it is named."""
    path = None
    if "escape" in reason:
        try:
            path = find_lone_surrogate(json.loads(raw.decode("utf-8")))
        except (ValueError, RecursionError):
            pass
    if not path:
        return ApiError(400, "The request body is not valid JSON.")
    location = ".".join(str(part) for part in path)
    return ApiError(
        400,
        f"Invalid value for '{location}': the text is not valid Unicode "
        "(a lone surrogate).",
        param=location,
    )


ENDPOINT_SCHEMAS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}
