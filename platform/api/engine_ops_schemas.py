"""Typed bodies of the endpoints that read a model without generating:
tokenize and detokenize (vLLM's shapes; llama.cpp server's `content` taken
for `prompt`), and rerank (Cohere's v1 and Jina's shape at /v1/rerank,
Cohere's v2 at /v2/rerank). The requests are checked like api.schemas' (a 400
naming the first bad field); the answers are api.bodies' kind of models, from
which /v1/openapi.json documents them (api.openapi)."""

from typing import Annotated, Literal

from pydantic import MISSING, Field, model_validator

from engines.wire.bounds import MAX_MESSAGES, MAX_TEXTS_PER_REQUEST
from engines.wire.requests import MAX_PROMPT_TOKENS, MAX_TOOLS

from .answer_formats import NamedToolChoice, Tool
from .bodies import Body, Count
from .schema_base import ModelName, Prompt, Strict, Text, field_error
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

# -- tokenize, detokenize ----------------------------------------------------------


class TokenizeRequest(Strict):
    """POST /tokenize: a completion's `prompt` (llama.cpp's `content`), or a
    chat's `messages` and tools, counted as a generation of them would be."""

    model: ModelName
    prompt: Prompt | None = None
    content: Prompt | None = None
    messages: (
        Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
        | None
    ) = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The opening of the assistant's turn, as generation adds it.
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_prompt(self) -> "TokenizeRequest":
        given = [
            name
            for name in ("prompt", "content", "messages")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise field_error(
                "prompt", "send exactly one of `prompt` (or `content`) and `messages`"
            )
        if self.messages is None:
            for name in ("tools", "tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    raise field_error(name, "is for `messages` only")
        return self

    @property
    def weight(self) -> int:
        return 1

    def generation(self) -> ChatCompletionRequest | CompletionRequest:
        """The generation request whose prompt this counts (built from this
        checked body; the engine checks the tools again)."""
        if self.messages is None:
            text = self.prompt if self.prompt is not None else self.content
            return CompletionRequest.model_construct(model=self.model, prompt=text)
        return ChatCompletionRequest.model_construct(
            model=self.model,
            messages=self.messages,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
        )


TokenIds = Annotated[
    list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKENS)
]


class DetokenizeRequest(Strict):
    """POST /detokenize: token ids back to text."""

    model: ModelName
    tokens: TokenIds

    @property
    def weight(self) -> int:
        return 1


class TokenizeResponse(Body):
    """vLLM's answer (llama.cpp's `tokens` among it)."""

    count: Count
    max_model_len: Count
    tokens: list[Count]


class DetokenizeResponse(Body):
    prompt: str


# -- rerank --------------------------------------------------------------------------


class RerankDocument(Strict):
    text: Text


class RerankRequest(Strict):
    """POST /v1/rerank (Cohere v1, Jina) and /v2/rerank (Cohere v2)."""

    model: ModelName
    query: Prompt
    documents: Annotated[
        list[Text | RerankDocument],
        Field(min_length=1, max_length=MAX_TEXTS_PER_REQUEST),
    ]
    # The best this many (all when unset).
    top_n: Annotated[int, Field(ge=1)] | None = None
    # Each result's document text beside its index (None: the endpoint's
    # default, yes at /v1/rerank as Jina answers, no at /v2/rerank).
    return_documents: bool | None = None

    @property
    def weight(self) -> int:
        """One engine request, however many documents (scored in one batch)."""
        return 1

    def texts(self) -> list[str]:
        return [
            document if isinstance(document, str) else document.text
            for document in self.documents
        ]


class RerankDocumentText(Body):
    text: str


class RerankResult(Body):
    index: Count
    relevance_score: float
    document: RerankDocumentText | MISSING = MISSING


class RerankUsage(Body):
    total_tokens: Count


class RerankResponse(Body):
    """/v1/rerank's answer: the results by relevance, best first."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class BilledUnits(Body):
    search_units: Count


class RerankMeta(Body):
    billed_units: BilledUnits


class RerankV2Response(Body):
    """/v2/rerank's answer (Cohere's v2)."""

    id: str
    results: list[RerankResult]
    meta: RerankMeta


RESPONSE_BODIES: tuple[type[Body], ...] = (
    TokenizeResponse,
    DetokenizeResponse,
    RerankResponse,
    RerankV2Response,
)
