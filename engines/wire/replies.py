"""What an engine answers, typed: the reply to each request kind, the frames
of a streamed generation (start, token..., done) and the whole answer of one
that is not streamed. The engine builds every reply through these models
(engines/runtime) and its clients read them back with them
(engines/wire/client.py): a key one side does not know is refused, and a
missing one too, so a schema mismatch is an error instead of a value
silently dropped or defaulted.

On the wire each reply is one JSON object (engines/wire/framing.py). A field
that is None is left out, and every field that may be None defaults to None:
a reply reads back equal to what was sent. An error reply (`status` "error")
may answer any request, and ends a stream in place of its `done`; the other
replies have `status` "ok", and a stream's frames name their `event`.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter

from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.framing import frame_bytes

# Why a generation ended: a stop (its end token or a stop string), its token
# budget or its context, the tools it called, or a cancel (by a caller's
# `cancel`, or a hang-up).
FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]
Phase = Literal["loading", "ready"]


class Frame(BaseModel):
    """One reply of an engine: unknown keys refused, values fixed once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def encoded(self) -> bytes:
        """The reply as one frame, its None fields left out."""
        return frame_bytes(self.model_dump_json(exclude_none=True).encode("utf-8"))


class Part(Frame):
    """A part of a reply (never sent alone)."""


# -- errors -----------------------------------------------------------------------


class ErrorReply(Frame):
    """A request that could not be served: its stable code (which the front
    maps to one HTTP status, platform/api/errors.py) and what went wrong."""

    status: Literal["error"] = "error"
    code: ErrorCode
    message: str

    @classmethod
    def of(cls, error: ProtocolError) -> "ErrorReply":
        return cls(code=error.code, message=error.message)


# -- control replies --------------------------------------------------------------


class OkReply(Frame):
    """`configure` and `shutdown`: done, nothing more to say."""

    status: Literal["ok"] = "ok"


class PingReply(OkReply):
    engine: str
    pid: int
    phase: Phase


class OffloadState(Part):
    """A GGUF model's layers on the engine's cards (OffloadPlan.describe):
    `gpu_layers` of `layers` (llama.cpp's count, the output layer included),
    the MiB planned on each card and on the CPU, and why, in one line."""

    gpu_layers: int
    layers: int
    cards_mib: dict[str, float]
    cpu_mib: float
    reason: str


class ModelState(Part):
    """One resident model as the engine describes it (ResidentModel.describe)."""

    name: str
    format: str
    memory_mib: float
    device_memory_mib: float
    estimated_mib: float | None = None
    loaded_at: float
    idle_s: float
    # Idle seconds before it is unloaded (ResidentModel.keep_alive_limit;
    # None: no limit).
    keep_alive_s: float | None = None
    inflight: int
    queued: int
    busy: int
    # An embedding model's batcher.
    batches: int | None = None
    batched_items: int | None = None
    largest_batch: int | None = None
    # A generation model's slots, decode passes and KV pool (SlotPlan.describe).
    slots: int | None = None
    steps: int | None = None
    slots_auto: bool | None = None
    context: int | None = None
    kv_pool_tokens: int | None = None
    kv_mib: float | None = None
    kv_groups: int | None = None
    kv_streams: bool | None = None
    copied_tokens: int | None = None
    offload: OffloadState | None = None
    # Measured: a generation model's tokens per second of its decode steps over
    # the last 30 s of work (engines/generation/runner.DecodeRate; None before
    # its first token), and what its load took on each card (MiB by the card's
    # label in offload plans; only cards that grew).
    tokens_per_s: float | None = None
    device_cards_mib: dict[str, float] | None = None
    # A transformers model: its precision and where its weights went
    # (engines/backends/hf_placement.py), in one line.
    placement: str | None = None


class Temperature(Part):
    device: str
    celsius: float


class StateReply(OkReply):
    """What the supervisor records of an engine. `healthy` is false, with the
    reason, when generation cannot go on; `cooling_reason` is "" unless the
    engine is too hot to compute."""

    engine: str
    pid: int
    port: int | None = None
    phase: Phase
    healthy: bool
    unhealthy_reason: str
    started_at: float
    models: list[ModelState]
    loading: list[str]
    # Models `unload` is draining: resident until their requests finish.
    unloading: list[str]
    queue_depth: int
    slots_in_use: int
    cooling_reason: str
    rss_mib: float
    temperatures: list[Temperature]
    tokens_generated: int
    # The engine's limits, as engines/launch/config.py's Limits writes them.
    limits: dict[str, JsonValue]


class LoadReply(OkReply):
    model: ModelState


class UnloadReply(OkReply):
    drained: bool


class CancelReply(OkReply):
    """Whether a request of that id was running or queued (it is cancelled)."""

    cancelled: bool


class EmbedUsage(Part):
    prompt_tokens: int


class EmbedReply(OkReply):
    """An embed request's header: the rows' shape and type, and the rows
    themselves as JSON (`encoding` json) or in the `.npy` frame that follows
    (`encoding` npy)."""

    model: str
    shape: list[int]
    dtype: str
    usage: EmbedUsage
    encoding: Literal["json", "npy"]
    embeddings: list[list[float]] | None = None
    # The wait for the model to be loaded, as a generation's Timings.load_ms.
    load_ms: float | None = None


class RerankReply(OkReply):
    """Each document's relevance to the query, in the documents' order, and
    the tokens the model read."""

    model: str
    scores: list[float]
    usage: EmbedUsage


class TokenizeReply(OkReply):
    """A prompt's token ids as a generation evaluates them, their count, and
    the most one request may hold (prompt and answer: the slot's context)."""

    model: str
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeReply(OkReply):
    model: str
    text: str


# -- generation ---------------------------------------------------------------------


class TopLogprob(Part):
    """One of the likeliest tokens at a position (OpenAI's shape)."""

    token: str
    logprob: float
    bytes: list[int]


class Logprob(TopLogprob):
    """A token's log-probability and the likeliest there. An echoed prompt's
    first token has none (None, no bytes, no top)."""

    logprob: float | None = None
    top_logprobs: list[TopLogprob]


class ToolCallDelta(Part):
    """A piece of a tool call as the answer is read: a call's first delta
    names it (`id`, `name`), its arguments' text comes in pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class CalledTool(Part):
    """A whole tool call the answer made: its arguments as JSON text."""

    id: str
    name: str
    arguments: str


class Usage(Part):
    """Tokens of one generation; `cached_tokens`: prompt tokens taken from a
    slot's cache instead of evaluated."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Timings(Part):
    """The engine's own times, from the request's arrival (a load it waited
    for included); no first token for an answer that had none."""

    first_token_ms: float | None = None
    total_ms: float
    # Of those, the wait for the model to be loaded (its load, or another
    # request's it waited for); None: it was resident when the request came.
    load_ms: float | None = None


class StartFrame(OkReply):
    """A stream's first frame, once a slot took the request: its prompt's
    token count, the oldest messages dropped to fit the context, and with
    `echo` the prompt's text."""

    event: Literal["start"] = "start"
    request_id: str
    prompt_tokens: int
    dropped_messages: int = 0
    prompt_text: str | None = None


class TokenFrame(OkReply):
    """A text chunk and the count of the tokens it holds (tokens inside a
    tool call's markup bring no text); their log-probabilities, and with
    `echo` the prompt's (with the first chunk); the tool-call deltas read
    from it."""

    event: Literal["token"] = "token"
    text: str
    tokens: int
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob] | None = None
    tool_calls: list[ToolCallDelta] | None = None


class Ending(OkReply):
    """How a generation ended: what a stream's `done` and a whole answer
    share."""

    request_id: str
    finish_reason: FinishReason
    usage: Usage
    tool_calls: list[CalledTool] | None = None
    # The stop string that ended the answer (finish_reason "stop"), if one did.
    stop_sequence: str | None = None
    dropped_messages: int = 0
    timings: Timings


class DoneFrame(Ending):
    """A stream's last frame."""

    event: Literal["done"] = "done"


class GenerateAnswer(Ending):
    """A `generate` request's one reply: the whole text, its log-probabilities
    where asked for, and with `echo` the prompt's text (and log-probabilities)."""

    text: str
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob] | None = None
    prompt_text: str | None = None


StreamEvent = Annotated[
    StartFrame | TokenFrame | DoneFrame, Field(discriminator="event")
]
# What a generate_stream connection carries: its frames, or an error.
StreamFrame = Annotated[StreamEvent | ErrorReply, Field(discriminator="status")]


def _or_error(reply: type[Frame]) -> TypeAdapter:
    return TypeAdapter(Annotated[reply | ErrorReply, Field(discriminator="status")])


# The reply each request kind gets (an error reply to any of them).
REPLIES: dict[str, TypeAdapter] = {
    "ping": _or_error(PingReply),
    "state": _or_error(StateReply),
    "load": _or_error(LoadReply),
    "unload": _or_error(UnloadReply),
    "embed": _or_error(EmbedReply),
    "rerank": _or_error(RerankReply),
    "tokenize": _or_error(TokenizeReply),
    "detokenize": _or_error(DetokenizeReply),
    "generate": _or_error(GenerateAnswer),
    "generate_stream": TypeAdapter(StreamFrame),
    "cancel": _or_error(CancelReply),
    "configure": _or_error(OkReply),
    "shutdown": _or_error(OkReply),
}


def parse_reply(kind: str, payload: bytes | dict[str, Any]) -> Any:
    """The reply to a request of `kind` (for generate_stream: one of its
    frames), from a frame's payload or its decoded object; pydantic's
    ValidationError when it is not one."""
    adapter = REPLIES[kind]
    if isinstance(payload, dict):
        return adapter.validate_python(payload)
    return adapter.validate_json(payload)
