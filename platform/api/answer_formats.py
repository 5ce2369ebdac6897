"""The request fields that shape an answer: tools the model may call (and the
calls of earlier turns), the choice among them, and a response format (JSON,
or JSON matching a schema). The engines hold the answer to them
(engines/constrained/grammar.py, engines/constrained/toolcalls.py)."""

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from engines.wire.requests import FUNCTION_NAME
from engines.wire.requests import ResponseFormat as EngineFormat

from .schema_base import FunctionName, JsonSchema, NoNul, Strict, Text


class FunctionCallIn(Strict):
    name: FunctionName
    arguments: Text


class ToolCallIn(Strict):
    """A call an earlier assistant turn made."""

    id: Annotated[str, Field(min_length=1, max_length=200), NoNul()]
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDefinition(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    # OpenAI's field name; `schema` would shadow pydantic's own attribute.
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat,
    Field(discriminator="type"),
]


def engine_format(
    fmt: TextFormat | JsonObjectFormat | JsonSchemaResponseFormat,
) -> EngineFormat:
    """The response format as the engine takes it (built from a checked body:
    not checked again)."""
    if isinstance(fmt, JsonSchemaResponseFormat):
        schema = fmt.json_schema.schema_ or {"type": "object"}
        return EngineFormat.model_construct(type="json_schema", json_schema=schema)
    return EngineFormat.model_construct(type=fmt.type)
