"""OpenAI's Responses API (`/v1/responses`) as typed models: the request body
(checked here, then translated onto a chat completion by
api.dialects.responses) and the answer's bodies, from which the OpenAPI
document is generated (api.openapi).

Fields the Responses API defines that Roundhouse cannot honour are refused
by name (`extra="forbid"`), or with a message that says why (built-in tools,
reasoning); fields that only tune OpenAI's own service are accepted and
ignored, as docs/using/responses.md lists."""

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    JsonValue,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engines.wire.bounds import MAX_MESSAGES

from ..answer_formats import JsonSchemaFormat
from ..bodies import Body, Count
from ..schema_base import (
    FunctionName,
    JsonSchema,
    MaxTokens,
    ModelName,
    Name,
    NoNul,
    Strict,
    Temperature,
    Text,
    field_error,
)

# Metadata as OpenAI bounds it: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA = 16
ItemId = Annotated[str, Field(min_length=1, max_length=200), NoNul()]
ResponseId = Annotated[str, Field(min_length=1, max_length=64), NoNul()]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# -- input items -------------------------------------------------------------------


class ResponseInputText(Strict):
    type: Literal["input_text"]
    text: Text


class ResponseOutputTextIn(Strict):
    """An earlier answer's text, sent back as the API answered it."""

    type: Literal["output_text"]
    text: Text
    annotations: list[JsonValue] | None = None
    logprobs: list[JsonValue] | None = None


MessageContent = Annotated[
    ResponseInputText | ResponseOutputTextIn, Field(discriminator="type")
]


class ResponseMessageItem(Strict):
    """A message: the caller's (user, system, developer) or an earlier answer
    (assistant). `type` may be left out (OpenAI's "easy" message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[MessageContent], Field(max_length=MAX_MESSAGES)]
    id: ItemId | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    """A call an earlier answer made (sent back as the API answered it)."""

    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: Text
    id: ItemId | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Strict):
    """The caller's result of a function call, by the call's `call_id`."""

    type: Literal["function_call_output"]
    call_id: ItemId
    output: Text | Annotated[list[ResponseInputText], Field(max_length=MAX_MESSAGES)]
    id: ItemId | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_type(value: Any) -> str:
    """An item's `type`; a message may leave it out."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[ResponseMessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="item_type",
        custom_error_message="an input item is a message, a function_call or a "
        "function_call_output (other item types are not supported)",
    ),
]


# -- tools, formats, reasoning ------------------------------------------------------


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormatText(Strict):
    type: Literal["text"]


class TextFormatJsonObject(Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    """OpenAI's `text.format` of a JSON schema: chat's `json_schema`, flat."""

    type: Literal["json_schema"]


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
    Field(discriminator="type"),
]


class ResponsesTextConfig(Strict):
    format: TextFormat | None = None
    # A hint to OpenAI's own models; accepted, not acted on.
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesReasoningConfig(Strict):
    """Accepted only empty: no model Roundhouse serves reasons, and OpenAI
    refuses reasoning settings for a model without reasoning."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @model_validator(mode="after")
    def _no_reasoning(self) -> "ResponsesReasoningConfig":
        for name in ("effort", "summary", "generate_summary"):
            if getattr(self, name) is not None:
                raise field_error(
                    f"reasoning.{name}",
                    "is not supported with this model (Roundhouse's models do not "
                    "reason; leave `reasoning` out)",
                )
        return self


class ResponsesStreamOptions(Strict):
    # OpenAI pads its stream events against a side channel; Roundhouse's are
    # not padded, whatever this says.
    include_obfuscation: bool | None = None


# -- the request -------------------------------------------------------------------


class ResponsesRequest(Strict):
    """POST /v1/responses."""

    model: ModelName
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoningConfig | None = None
    store: bool = True
    previous_response_id: ResponseId | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=64), NoNul()],
                Annotated[str, Field(max_length=512), NoNul()],
            ],
            Field(max_length=MAX_METADATA),
        ]
        | None
    ) = None
    user: Name | None = None
    # Accepted and not acted on: routing keeps a caller's prompt cache by
    # its own affinity; nothing is hidden that `include` could add.
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    include: list[Annotated[str, Field(max_length=100), NoNul()]] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # Only "disabled" (OpenAI's default): a conversation longer than the
    # model's context is refused, or shortened as the model's own setting
    # says (its context overflow).
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for tool in value:
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise PydanticCustomError(
                        "tool",
                        "the built-in tool '{kind}' is not supported: Roundhouse "
                        "runs function tools only",
                        {"kind": kind[:64]},
                    )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "ResponsesRequest":
        if isinstance(self.input, list) and not self.input:
            raise field_error("input", "needs at least one item")
        fmt = self.text.format if self.text else None
        if self.tools and fmt is not None and fmt.type != "text":
            raise field_error(
                "text.format", "a JSON answer cannot be asked for with tools"
            )
        return self

    @property
    def weight(self) -> int:
        return 1


# -- the answer --------------------------------------------------------------------


class ResponseOutputText(Body):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[JsonValue] = []
    logprobs: list[JsonValue] = []


class ResponseOutputMessage(Body):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[ResponseOutputText]


class ResponseFunctionCall(Body):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[
    ResponseOutputMessage | ResponseFunctionCall, Field(discriminator="type")
]


class ResponseInputTokensDetails(Body):
    """Of the input tokens, those taken from the engine's prompt cache, and
    those evaluated (and so written to it)."""

    cached_tokens: Count
    cache_write_tokens: Count


class ResponseOutputTokensDetails(Body):
    reasoning_tokens: Count = 0


class ResponseUsage(Body):
    input_tokens: Count
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: Count
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: Count


class ResponseError(Body):
    code: str
    message: str


class ResponseIncompleteDetails(Body):
    """Why a response stopped short: its max_output_tokens, or (Roundhouse's
    own reason) a streamed one's caller went away before its end."""

    reason: Literal["max_output_tokens", "client_disconnected"]


class ResponseReasoning(Body):
    effort: None = None
    summary: None = None


class ResponseTextConfig(Body):
    format: dict[str, JsonValue]


class Response(Body):
    """The Response object: an answer as POST /v1/responses gives it and
    GET /v1/responses/{id} gives it again (`output_text` is the clients'
    own convenience, not sent)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: ResponseError | None = None
    incomplete_details: ResponseIncompleteDetails | None = None
    background: bool = False
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ResponseReasoning = ResponseReasoning()
    service_tier: str = "default"
    store: bool
    temperature: float | None = None
    text: ResponseTextConfig
    tool_choice: str | dict[str, JsonValue]
    tools: list[dict[str, JsonValue]]
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseDeleted(Body):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class InputItemList(Body):
    """A page of a stored response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, JsonValue]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class StreamEvent(Body):
    """One event of a streamed response: its `type` (response.created, …,
    response.completed) and its place in the stream; the rest of its keys
    are the event type's own (OpenAI's)."""

    model_config = ConfigDict(extra="allow", from_attributes=True)

    type: str
    sequence_number: Count


RESPONSE_BODIES: tuple[type[Body], ...] = (
    Response,
    ResponseDeleted,
    InputItemList,
    StreamEvent,
)
