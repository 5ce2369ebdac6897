"""The API's response bodies, in OpenAI's shapes, as typed models (vLLM's
`protocol.py`): the answers (api.answers, which the Batch API records too), the
streams' chunks (api.sse), the model list (api.views) and the Batch API's files
and batches (batches.selectors) are these models serialised; the error object
(api.errors.ApiError.body) is ErrorResponse's shape, which a test checks.
/v1/openapi.json documents them from these models alone (api.openapi).

A key the API leaves out when it has nothing to say defaults to MISSING (it is
absent from the JSON); a key it sends as null is None. `BodySchema` documents
exactly that: every key is required but those that may be MISSING.
"""

from typing import Annotated, Literal

from pydantic import MISSING, BaseModel, ConfigDict, Field
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import core_schema

from .schemas import MAX_CHOICES

Count = Annotated[int, Field(ge=0)]
# A log-probability; a token's is never above 0 (a probability of 1).
LogprobValue = Annotated[float, Field(le=0)]
FinishReason = Literal["stop", "length", "tool_calls"]


class BodySchema(GenerateJsonSchema):
    """The JSON Schema of a body as sent: every key is required (a default is
    sent too) but one that may be MISSING, which is left out."""

    def field_is_required(
        self,
        field: core_schema.ModelField
        | core_schema.DataclassField
        | core_schema.TypedDictField,
        total: bool,
    ) -> bool:
        schema = field["schema"]
        return schema["type"] != "default" or schema.get("default") is not MISSING


class Body(BaseModel):
    """A response body or a part of one: it declares every key the API sends
    (another is refused), and reads the engine's wire models by attribute."""

    model_config = ConfigDict(extra="forbid", from_attributes=True)


# -- parts ---------------------------------------------------------------------


class PromptTokensDetails(Body):
    """Of the prompt's tokens, those taken from a slot's prompt cache instead of
    evaluated again."""

    cached_tokens: Count


class Usage(Body):
    """The tokens of an answer: each prompt's once, every choice's completion."""

    prompt_tokens: Count
    completion_tokens: Count
    total_tokens: Count
    prompt_tokens_details: PromptTokensDetails


class Timings(Body):
    """Roundhouse's addition: the engine that answered (and its node, on a
    cluster; "" on one host) and its own times from the request's arrival."""

    engine: str
    node: str
    engine_first_token_ms: float | None
    engine_total_ms: float


class TopLogprob(Body):
    """One of the likeliest tokens at a position."""

    token: str
    logprob: LogprobValue
    bytes: list[int]


class ChatCompletionTokenLogprob(TopLogprob):
    """A token's log-probability, and the likeliest tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Body):
    """Chat's log-probabilities of a choice's tokens."""

    content: list[ChatCompletionTokenLogprob]
    refusal: None = None


class CompletionLogprobs(Body):
    """Completions' (legacy) log-probabilities, one entry per token in each
    list. An echoed prompt's first token has neither a log-probability nor
    top tokens (null)."""

    tokens: list[str]
    token_logprobs: list[LogprobValue | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[Count]


class CalledFunction(Body):
    """The function a tool call calls, its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(Body):
    """A whole tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionDelta(Body):
    """A piece of a tool call's function: its name in its first delta."""

    name: str | MISSING = MISSING
    arguments: str


class ToolCallDelta(Body):
    """A piece of a tool call: its id, type and name in its first delta, its
    arguments in pieces."""

    index: Count
    id: str | MISSING = MISSING
    type: Literal["function"] | MISSING = MISSING
    function: FunctionDelta


# -- /v1/chat/completions --------------------------------------------------------


class ChatCompletionMessage(Body):
    """The assistant's message: its text (null when it only calls tools) and
    its tool calls, if any."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | MISSING = MISSING


class ChatCompletionChoice(Body):
    """One choice: its message and how it ended."""

    index: Count
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class Answer(Body):
    """What every answer and chunk says first: its id, when, which model."""

    id: str
    created: int
    model: str
    system_fingerprint: None = None


class Chunk(Answer):
    """What every streamed chunk carries beside its choice: with
    `include_usage`, `usage` (null but in a last chunk with no choice and the
    usage of them all), and a choice's timings in its last chunk."""

    usage: Usage | None | MISSING = MISSING
    timings: Timings | MISSING = MISSING


class ChatCompletion(Answer):
    """A chat completion: its choices (`n`), the usage of them all, and
    timings."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: Annotated[
        list[ChatCompletionChoice], Field(min_length=1, max_length=MAX_CHOICES)
    ]
    usage: Usage
    timings: Timings


class ChoiceDelta(Body):
    """What a chunk adds to its choice's message: the role (first chunk), text,
    tool calls' pieces; nothing in a choice's last chunk."""

    role: Literal["assistant"] | MISSING = MISSING
    content: str | MISSING = MISSING
    tool_calls: list[ToolCallDelta] | MISSING = MISSING


class ChatCompletionChunkChoice(Body):
    """A chunk's choice: its delta; its finish reason in its last chunk."""

    index: Count
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(Chunk):
    """A streamed chunk: one choice's delta (its finish reason in its last)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: Annotated[list[ChatCompletionChunkChoice], Field(max_length=1)]


# -- /v1/completions --------------------------------------------------------------


class CompletionChoice(Body):
    """One choice: its text (the echoed prompt first) and how it ended."""

    index: Count
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(Answer):
    """A completion: its choices (`n` per prompt, prompts in order), the usage
    of them all, and timings."""

    object: Literal["text_completion"] = "text_completion"
    choices: Annotated[
        list[CompletionChoice], Field(min_length=1, max_length=MAX_CHOICES)
    ]
    usage: Usage
    timings: Timings


class CompletionChunkChoice(Body):
    """A chunk's choice: its text; its finish reason in its last chunk."""

    index: Count
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionChunk(Chunk):
    """A streamed chunk: one choice's text (its finish reason in its last)."""

    object: Literal["text_completion"] = "text_completion"
    choices: Annotated[list[CompletionChunkChoice], Field(max_length=1)]


# -- /v1/embeddings ---------------------------------------------------------------


class Embedding(Body):
    """One input's embedding: floats, or with encoding_format base64
    little-endian float32 in base64."""

    object: Literal["embedding"] = "embedding"
    index: Count
    embedding: list[float] | str


class EmbeddingUsage(Body):
    """The tokens of the inputs."""

    prompt_tokens: Count
    total_tokens: Count


class CreateEmbeddingResponse(Body):
    """One embedding per input, in order."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# -- /v1/models ---------------------------------------------------------------------


class Model(Body):
    """A model the key may use."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(Body):
    """The enabled models the key may use, each once."""

    object: Literal["list"] = "list"
    data: list[Model]


class ModelDeleted(Body):
    """A model deleted from the catalog (DELETE /v1/models/{name}), and the
    bytes of its files freed on the host that answered."""

    id: str
    object: Literal["model"] = "model"
    deleted: Literal[True] = True
    bytes_freed: Count


# -- /v1/pulls ----------------------------------------------------------------------

PullState = Literal["queued", "running", "done", "failed", "cancelled"]


class ModelPull(Body):
    """A model being pulled from where models live (the Hugging Face Hub, an
    https:// address) into the catalog: its progress, and once done the
    model's name. Times are Unix seconds."""

    id: int
    object: Literal["model.pull"] = "model.pull"
    source: str
    name: str
    node: str
    # Why it runs on that node when none was asked for ("" when one was, or
    # on one host): where the model's first replica is placed.
    node_reason: str = ""
    status: PullState
    size_bytes: Count
    done_bytes: Count
    rate_bytes_per_s: Annotated[float, Field(ge=0)]
    seconds_left: Annotated[float, Field(ge=0)] | None
    message: str
    model: str | None
    created_at: int
    finished_at: int | None


class ModelPullList(Body):
    """A page of pulls, newest first: `has_more` says whether older ones
    follow (ask again with `after` the page's `last_id`)."""

    object: Literal["list"] = "list"
    data: list[ModelPull]
    first_id: int | None
    last_id: int | None
    has_more: bool


# -- /v1/files and /v1/batches (batches.views) -------------------------------------

FilePurpose = Literal["batch", "batch_output"]
BatchStatus = Literal[
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
]


class FileObject(Body):
    """A stored file: an upload (purpose "batch") or a batch's output or error
    file ("batch_output"). Times are Unix seconds."""

    id: str
    object: Literal["file"] = "file"
    bytes: Count
    created_at: int
    filename: str
    purpose: FilePurpose
    # A file is usable once stored: there is no processing to wait for.
    status: Literal["processed"] = "processed"
    status_details: None = None


class FileList(Body):
    """The key's files (all of them: `has_more` is always false)."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool


class FileDeleted(Body):
    """A file deleted, and its bytes."""

    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True


class BatchError(Body):
    """Why a batch failed as a whole (its lines' errors are in its error file)."""

    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(Body):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(Body):
    """The batch's lines: all of them, those answered and those that failed."""

    total: Count
    completed: Count
    failed: Count


class Batch(Body):
    """A batch of requests from an uploaded file, answered by the workers:
    its status, its output and error files once done. Times are Unix seconds
    (null until it gets there)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None


class BatchList(Body):
    """A page of batches, newest first: `has_more` says whether older ones
    follow (ask again with `after` the page's `last_id`)."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- errors -------------------------------------------------------------------------


class Error(Body):
    """What failed: `param` names the field at fault, `code` the failure."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Body):
    """OpenAI's error object: every failure's body, and the event that ends a
    stream the engine failed once it had started."""

    error: Error


# The bodies /v1/openapi.json documents (api.openapi), with their parts.
RESPONSE_BODIES: tuple[type[Body], ...] = (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    CreateEmbeddingResponse,
    ModelList,
    ModelDeleted,
    ModelPull,
    ModelPullList,
    FileObject,
    FileList,
    FileDeleted,
    Batch,
    BatchList,
    ErrorResponse,
)
