"""The building blocks of the API's request schemas (api.schemas): a model
that refuses unknown fields and checks every text as the engines do, and the
bounded field types, the engines' own bounds (engines.wire.framing) checked
first so that a bad value is a 400 naming its field before any engine is
asked."""

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    JsonValue,
    WithJsonSchema,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from engines.wire.bounds import (
    MAX_PENALTY,
    MAX_PROMPT_CHARS,
    MAX_STOP_CHARS,
    MAX_TEMPERATURE,
    MAX_TOKENS_CAP,
    MIN_TEMPERATURE,
    TEMPERATURE_RANGE,
    check_text,
)
from engines.wire.errors import ProtocolError
from engines.wire.requests import FUNCTION_NAME


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


# The bounds are the engines' own (engines.wire.framing), checked here first so that
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


FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME)]
# A JSON schema (a response format's, a tool's parameters): its size is
# bounded by the engines (generate_request.MAX_SCHEMA_CHARS) and its features
# by the grammar library, which names what it does not support.
JsonSchema = dict[str, JsonValue]


def field_error(field: str, message: str) -> PydanticCustomError:
    """A body whose fields disagree: named by the field at fault."""
    return PydanticCustomError(
        "consistency", "{message}", {"field": field, "message": message}
    )
