"""Typed request bodies of the OpenAI-compatible endpoints.

The same classes validate requests and produce `/v1/openapi.json`, so the document
always matches what the endpoints accept. Fields OpenAI defines that Roundhouse
does not implement are refused by name (`extra="forbid"`) rather than ignored.
"""

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    WithJsonSchema,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from engines.protocol import (
    MAX_MESSAGES,
    MAX_PENALTY,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TEXTS_PER_REQUEST,
    MAX_TOKENS_CAP,
    MIN_TEMPERATURE,
    TEMPERATURE_RANGE,
    ProtocolError,
    check_text,
    find_lone_surrogate,
)

from .errors import ApiError


@dataclass(frozen=True)
class NoNul:
    """States in the JSON Schema (as a `pattern`) the rule `Strict._clean_text`
    enforces on every string: no NUL character. The check itself stays a plain
    search, which names the field; a regex would scan each text once more."""

    PATTERN = r"^[^\u0000]*$"

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {**handler(schema), "pattern": self.PATTERN}


# The bounds are the engines' own (engines.protocol), checked here first so that
# a bad value is a 400 naming its field before any engine is asked.
Name = Annotated[str, NoNul()]
ModelName = Annotated[str, Field(min_length=1, max_length=200), NoNul()]
Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS), NoNul()]
# The engine refuses an empty prompt: so does the schema.
Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS), NoNul()]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), NoNul()]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_CAP)]
# 0 is greedy; between 0 and MIN_TEMPERATURE is refused (`_greedy_or_warm`),
# which the document states as one of two alternatives.
Temperature = Annotated[
    float,
    Field(ge=0, le=MAX_TEMPERATURE),
    WithJsonSchema(
        {
            "anyOf": [
                {"const": 0},
                {
                    "type": "number",
                    "minimum": MIN_TEMPERATURE,
                    "maximum": MAX_TEMPERATURE,
                },
            ],
            "description": TEMPERATURE_RANGE,
        }
    ),
]


class Strict(BaseModel):
    # NaN and infinities are refused: a JSON body can carry them (`NaN`, `1e999`).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _clean_text(cls, value: Any) -> Any:
        """Every string a caller sends, alone or in a list: the engines' check (no
        NUL character, valid Unicode)."""
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, str):
                try:
                    check_text(item, "the text")
                except ProtocolError as error:
                    raise PydanticCustomError("text", error.message) from None
        return value


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Name | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


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
    n: Literal[1] | None = None
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


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    # Log-probabilities are computed by the engines but not yet mapped to
    # OpenAI's token-string shape: only "off" is accepted.
    logprobs: Literal[False] = False

    @field_validator("messages")
    @classmethod
    def _within_prompt_cap(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if sum(len(message.text()) for message in value) > MAX_PROMPT_CHARS:
            raise PydanticCustomError(
                "too_long", f"messages exceed the cap of {MAX_PROMPT_CHARS} characters"
            )
        return value

    def engine_fields(self) -> dict[str, Any]:
        fields = self.sampling()
        fields["messages"] = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None:
            fields["max_tokens"] = limit
        return fields


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=1)]
    max_tokens: MaxTokens | None = 16
    echo: Literal[False] = False
    logprobs: None = None

    def engine_fields(self) -> dict[str, Any]:
        fields = self.sampling()
        fields["prompt"] = (
            self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        )
        if self.max_tokens is not None:
            fields["max_tokens"] = self.max_tokens
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
