"""Ollama's request and response bodies as typed models (vLLM's
`protocol.py`): the requests validate what /api/... accepts (every field
Ollama's API defines is named; one Roundhouse cannot honour is refused by name
in serving.py, and an unknown field is refused as elsewhere), the responses
are what the answers are built with; /v1/openapi.json documents both.

Ollama's `options` are the exception: Ollama ignores an option it does not
know (num_ctx, mirostat, ...), so they do too; the sampling ones are typed
here and bounded by the OpenAI-shaped request they are translated into."""

from typing import Annotated, Any, Literal

from pydantic import (
    MISSING,
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    model_validator,
)

from engines.wire.bounds import MAX_STOP_STRINGS, MAX_TEXTS_PER_REQUEST

from ...answer_formats import Tool
from ...bodies import Body
from ...schema_base import (
    FunctionName,
    JsonSchema,
    ModelName,
    Name,
    NoNul,
    StopText,
    Strict,
    Text,
    field_error,
)
from .durations import keep_alive_seconds

# Ollama's keep_alive: a duration ("5m", "1h"), seconds, or below 0 (no
# limit); read as seconds (durations.keep_alive_seconds: -1 for no limit).
KeepAlive = Annotated[
    Annotated[str, Field(max_length=32), NoNul()] | float,
    AfterValidator(keep_alive_seconds),
]
Format = Literal["", "json"] | JsonSchema


class Options(BaseModel):
    """Ollama's `options`: the sampling ones typed, any other ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    num_predict: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CalledFunctionIn(Strict):
    name: FunctionName
    arguments: dict[str, JsonValue] = Field(default_factory=dict)
    index: int | None = None


class ToolCallIn(Strict):
    """A call an earlier assistant message made (Ollama's shape: its
    arguments an object)."""

    id: Annotated[str, Field(max_length=200), NoNul()] | None = None
    type: Literal["function"] | None = None
    function: CalledFunctionIn


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None
    # Refused (serving.py): no model served here reads images.
    images: list[Annotated[str, NoNul()]] | None = None
    # An assistant message's reasoning, as Ollama returned it: not sent on.
    thinking: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    # A tool message: which tool answered (Ollama's), or which call.
    tool_name: Name | None = None
    tool_call_id: Annotated[str, Field(max_length=200), NoNul()] | None = None


class Generation(Strict):
    """What /api/chat and /api/generate share."""

    model: ModelName
    stream: bool = True
    format: Format | None = None
    options: Options | None = None
    # How long the model may stay idle after this request (serving.py;
    # docs/using/ollama.md).
    keep_alive: KeepAlive | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Ollama's context handling: accepted, the model's context_overflow
    # setting decides instead.
    truncate: bool | None = None
    shift: bool | None = None

    @property
    def weight(self) -> int:
        return 1


class ChatBody(Generation):
    """POST /api/chat."""

    messages: Annotated[list[Message], Field(max_length=1024)] = Field(
        default_factory=list
    )
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None


class GenerateBody(Generation):
    """POST /api/generate."""

    prompt: Text = ""
    system: Text | None = None
    # Refused when given (serving.py): Roundhouse applies the model's own
    # chat template, and keeps no token context between requests.
    suffix: Text | None = None
    template: Text | None = None
    context: list[int] | None = None
    images: list[Annotated[str, NoNul()]] | None = None
    # The prompt as it is, no chat template: a plain completion.
    raw: bool | None = None


class EmbedBody(Strict):
    """POST /api/embed."""

    model: ModelName
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_TEXTS_PER_REQUEST)]
    )
    truncate: bool | None = None
    options: Options | None = None
    keep_alive: KeepAlive | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None

    @property
    def weight(self) -> int:
        return 1


class EmbeddingsBody(Strict):
    """POST /api/embeddings (Ollama's older embedding endpoint: one prompt)."""

    model: ModelName
    prompt: Text
    options: Options | None = None
    keep_alive: KeepAlive | None = None

    @property
    def weight(self) -> int:
        return 1


class NamedBody(Strict):
    """A body that names a model: `model`, or Ollama's older `name`."""

    model: ModelName | None = None
    name: ModelName | None = None

    @model_validator(mode="after")
    def _named(self) -> "NamedBody":
        if not (self.model or self.name):
            raise field_error("model", "the model to use is required")
        return self

    @property
    def named(self) -> str:
        return self.model or self.name or ""


class ShowBody(NamedBody):
    """POST /api/show."""

    verbose: bool | None = None


class PullBody(NamedBody):
    """POST /api/pull: `hf.co/ORG/REPO[:QUANTIZATION]`."""

    insecure: bool | None = None
    stream: bool = True
    username: Annotated[str, Field(max_length=200), NoNul()] | None = None
    password: Annotated[str, Field(max_length=200), NoNul()] | None = None


# -- responses -------------------------------------------------------------------


class CalledFunction(Body):
    name: str
    arguments: dict[str, Any]


class ToolCall(Body):
    function: CalledFunction


class AnswerMessage(Body):
    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[ToolCall] = MISSING


class Final(Body):
    """The counts and times (nanoseconds) an answer's last object carries."""

    done_reason: Literal["stop", "length", "load", "unload"] = MISSING
    total_duration: int = MISSING
    load_duration: int = MISSING
    prompt_eval_count: int = MISSING
    prompt_eval_duration: int = MISSING
    eval_count: int = MISSING
    eval_duration: int = MISSING


class ChatChunk(Final):
    """/api/chat's answer, or one line of its stream."""

    model: str
    created_at: str
    message: AnswerMessage
    done: bool


class GenerateChunk(Final):
    """/api/generate's answer, or one line of its stream."""

    model: str
    created_at: str
    response: str
    done: bool


class EmbedResponse(Body):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingsResponse(Body):
    embedding: list[float]


class Details(Body):
    parent_model: str = ""
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class ListedModel(Body):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details


class TagsResponse(Body):
    models: list[ListedModel]


class ShowResponse(Body):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class RunningModel(Body):
    """A model loaded on an engine; `engine` and `node` are Roundhouse's."""

    name: str
    model: str
    size: int
    size_vram: int
    digest: str
    details: Details
    expires_at: str
    context_length: int
    engine: str
    node: str


class PsResponse(Body):
    models: list[RunningModel]


class VersionResponse(Body):
    version: str


class Progress(Body):
    """One line of /api/pull's stream (or its whole answer: the last)."""

    status: str
    digest: str = MISSING
    total: int = MISSING
    completed: int = MISSING


class ErrorResponse(Body):
    """Every refusal and failure, in Ollama's shape."""

    error: str
