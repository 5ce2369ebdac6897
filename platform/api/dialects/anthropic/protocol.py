"""Typed bodies of Anthropic's Messages API: the requests (validated, and
documented in /v1/openapi.json) and the answers, stream events and errors
(built, and documented, from these models).

Unknown keys are refused, as Anthropic refuses them. Fields Anthropic documents
that do not change what a Roundhouse model answers are accepted and ignored
(`metadata`, `service_tier`, `speed`, `inference_geo`, `diagnostics`,
`user_profile_id`, `workspace_id`; `cache_control` anywhere: Roundhouse's prompt
cache is automatic; `thinking`: these models do not think aloud;
`output_config.effort`; thinking blocks sent back in the history). Content
Roundhouse cannot read (images, documents, server tools) is refused by name.
Every class is named `Anthropic...`: the OpenAPI document holds OpenAI's bodies
beside them.
"""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, JsonValue, model_validator

from engines.wire.bounds import MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOP_K
from engines.wire.requests import MAX_TOOLS

from ...bodies import Body, Count
from ...schema_base import (
    FunctionName,
    JsonSchema,
    MaxTokens,
    ModelName,
    NoNul,
    StopText,
    Strict,
    Text,
)

# Content blocks one message (or a tool result, or the system prompt) may hold.
MAX_BLOCKS = 256
Id = Annotated[str, Field(min_length=1, max_length=200), NoNul()]


class AnthropicCacheControl(Strict):
    """Anthropic's cache breakpoint: accepted, not needed (every prefix is
    cached by the engine)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class AnthropicTextBlockIn(Strict):
    type: Literal["text"]
    text: Text
    cache_control: AnthropicCacheControl | None = None
    # Sent back as they came (Roundhouse's answers cite nothing).
    citations: list[JsonValue] | None = None


class AnthropicToolUseBlockIn(Strict):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: Id
    name: FunctionName
    input: dict[str, JsonValue]
    cache_control: AnthropicCacheControl | None = None


class AnthropicUnreadableBlock(Strict):
    """Content no Roundhouse model reads: refused with its name (in
    translation), whatever it holds."""

    model_config = ConfigDict(extra="allow")

    type: Literal[
        "image",
        "document",
        "search_result",
        "container_upload",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
    ]


class AnthropicToolResultBlockIn(Strict):
    """The answer to a call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Id
    content: (
        Text
        | Annotated[
            list[AnthropicTextBlockIn | AnthropicUnreadableBlock],
            Field(max_length=MAX_BLOCKS),
        ]
        | None
    ) = None
    is_error: bool | None = None
    cache_control: AnthropicCacheControl | None = None


class AnthropicThinkingBlockIn(Strict):
    """An earlier turn's thinking, sent back: dropped (as Anthropic drops the
    thinking of earlier turns)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: Text | None = None
    signature: Annotated[str, Field(max_length=100_000)] | None = None
    data: Annotated[str, Field(max_length=100_000)] | None = None
    cache_control: AnthropicCacheControl | None = None


AnthropicBlockIn = Annotated[
    AnthropicTextBlockIn
    | AnthropicToolUseBlockIn
    | AnthropicToolResultBlockIn
    | AnthropicThinkingBlockIn
    | AnthropicUnreadableBlock,
    Field(discriminator="type"),
]


class AnthropicMessageIn(Strict):
    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[AnthropicBlockIn], Field(max_length=MAX_BLOCKS)]


class AnthropicTool(Strict):
    """A client tool: the model may call it with `input` matching its
    schema. (Server tools, with another `type`, are refused.)"""

    name: FunctionName
    description: Text | None = None
    input_schema: JsonSchema
    type: Literal["custom"] | None = None
    cache_control: AnthropicCacheControl | None = None
    # The engine holds every call to its schema already.
    strict: bool | None = None
    eager_input_streaming: bool | None = None


class AnthropicToolChoice(Strict):
    """auto: the model decides; any: it calls one of the tools; tool: it calls
    the one named; none: it calls none."""

    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> "AnthropicToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("`name` is required with type 'tool', and only then")
        return self


class AnthropicThinking(Strict):
    """Extended thinking: accepted, and answered without thinking blocks."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class AnthropicMetadata(Strict):
    user_id: Annotated[str, Field(max_length=512), NoNul()] | None = None


class AnthropicDiagnostics(Strict):
    previous_message_id: Annotated[str, Field(max_length=200), NoNul()] | None = None


Label = Annotated[str, Field(max_length=200), NoNul()]


class AnthropicJsonFormat(Strict):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class AnthropicOutputConfig(Strict):
    """`format`: the answer held to a JSON schema; `effort` is accepted."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AnthropicJsonFormat | None = None


class AnthropicInput(Strict):
    """What the prompt is made of: what count_tokens counts."""

    model: ModelName
    messages: Annotated[
        list[AnthropicMessageIn], Field(min_length=1, max_length=MAX_MESSAGES)
    ]
    system: (
        Text
        | Annotated[list[AnthropicTextBlockIn], Field(max_length=MAX_BLOCKS)]
        | None
    ) = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    cache_control: AnthropicCacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: Label | None = None
    workspace_id: Label | None = None

    @property
    def weight(self) -> int:
        """One engine request (api.limits)."""
        return 1


class AnthropicMessagesRequest(AnthropicInput):
    """POST /v1/messages."""

    max_tokens: MaxTokens
    stop_sequences: (
        Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None
    ) = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: Label | None = None
    diagnostics: AnthropicDiagnostics | None = None


class AnthropicCountTokensRequest(AnthropicInput):
    """POST /v1/messages/count_tokens."""


# -- answers ---------------------------------------------------------------------


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicTextBlock(Body):
    type: Literal["text"] = "text"
    text: str
    citations: None = None


class AnthropicToolUseBlock(Body):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    # Any JSON object (not JsonValue: the requests' schema of that name).
    input: dict[str, Any]


AnthropicContentBlock = Annotated[
    AnthropicTextBlock | AnthropicToolUseBlock, Field(discriminator="type")
]


class AnthropicUsage(Body):
    """`input_tokens` are the prompt's tokens evaluated; those taken from the
    engine's prompt cache are `cache_read_input_tokens` (Anthropic's sum)."""

    input_tokens: Count
    output_tokens: Count
    cache_creation_input_tokens: Count = 0
    cache_read_input_tokens: Count = 0


class AnthropicMessage(Body):
    """POST /v1/messages' answer."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[AnthropicContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(Body):
    """POST /v1/messages/count_tokens' answer."""

    input_tokens: Count


class AnthropicErrorDetail(Body):
    type: Literal[
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "timeout_error",
        "overloaded_error",
    ]
    message: str


class AnthropicErrorResponse(Body):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# -- stream events -----------------------------------------------------------------


class AnthropicTextDelta(Body):
    type: Literal["text_delta"] = "text_delta"
    text: str


class AnthropicInputJsonDelta(Body):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class AnthropicMessageStart(Body):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage


class AnthropicContentBlockStart(Body):
    type: Literal["content_block_start"] = "content_block_start"
    index: Count
    content_block: AnthropicContentBlock


class AnthropicContentBlockDelta(Body):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: Count
    delta: Annotated[
        AnthropicTextDelta | AnthropicInputJsonDelta, Field(discriminator="type")
    ]


class AnthropicContentBlockStop(Body):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: Count


class AnthropicMessageDeltaFields(Body):
    stop_reason: StopReason | None
    stop_sequence: str | None


class AnthropicMessageDelta(Body):
    """The message's end: why it stopped, and its final usage."""

    type: Literal["message_delta"] = "message_delta"
    delta: AnthropicMessageDeltaFields
    usage: AnthropicUsage


class AnthropicMessageStop(Body):
    type: Literal["message_stop"] = "message_stop"


class AnthropicPing(Body):
    type: Literal["ping"] = "ping"


STREAM_EVENTS: tuple[type[Body], ...] = (
    AnthropicMessageStart,
    AnthropicPing,
    AnthropicContentBlockStart,
    AnthropicContentBlockDelta,
    AnthropicContentBlockStop,
    AnthropicMessageDelta,
    AnthropicMessageStop,
    AnthropicErrorResponse,
)
