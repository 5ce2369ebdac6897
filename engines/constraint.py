"""Constrained decoding: an answer that must be JSON (any object, or one
matching a schema) or a call of the offered tools is generated token by token
under a grammar, with llguidance (the library behind vLLM's and SGLang's
`guidance` grammar backends and llama.cpp's optional one; it reads llama.cpp
vocabularies and Hugging Face tokenizers alike, so both backends share it).

Each constrained request has its own matcher (its grammar's parser state).
Before a pass, the masks of the tokens allowed next are computed for every
constrained slot that samples in it, in a helper thread while the model's
forward pass runs (both release the GIL): a constrained slot adds no wait to
the pass, and free slots in the same batch pay nothing. After the pass each
mask is applied to its slot's logits before sampling, and the matcher takes
the sampled token.

Grammars are compiled once per grammar text (a schema, a set of tools) and
cached per model: a request starts from a copy of the cached matcher."""

import collections
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from .generate_request import Function, GenerateRequest, NamedTool
from .protocol import ErrorCode, ProtocolError
from .toolcalls import TOOL_CLOSE, TOOL_OPEN

log = logging.getLogger("roundhouse.engine.constraint")

# JSON as OpenAI writes it: one space after `:` and `,`, no other whitespace
# (free whitespace lets a small model pad an answer with newlines forever).
JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Compiled grammars kept per model (least recently used dropped first).
CACHED_GRAMMARS = 64


def _with_style(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with our JSON style (the schema's own `x-guidance` wins)."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def call_schema(tools: list[Function]) -> dict[str, Any]:
    """A call of one of the tools: its name, then arguments matching it."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                "arguments": tool.parameters,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return _with_style(options[0] if len(options) == 1 else {"anyOf": options})


def grammar_for(
    request: GenerateRequest, *, special_tags: bool
) -> tuple[str, str] | None:
    """The llguidance grammar an answer must follow and what it stands for
    (named in errors), or None for free text. `special_tags`: the tool-call
    tags are single special tokens in this model's vocabulary."""
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        schema = _with_style({"type": "object"})
        return llguidance.LLMatcher.grammar_from_json_schema(schema), "response_format"
    if fmt is not None and fmt.type == "json_schema":
        schema = _with_style(dict(fmt.json_schema or {}))
        where = "response_format.json_schema.schema"
        return llguidance.LLMatcher.grammar_from_json_schema(schema), where
    if not request.offers_tools:
        return None
    tools = list(request.tools)
    choice = request.tool_choice or "auto"
    if isinstance(choice, NamedTool):
        tools = [tool for tool in tools if tool.name == choice.name]
    call = _call_rule(tools, special_tags)
    if choice == "auto":
        # Free text until the model opens a call (a lazy trigger); the
        # call itself is held to the tools' schemas.
        lark = (
            "%llguidance {}\n"
            "start: (call)* TEXT\n"
            f"call: trigger {call[1]}\n"
            f"trigger[lazy]: TEXT {call[0]}\n"
            "TEXT: /(.|\\n)*/\n"
        )
    else:  # required, or a named function
        repeat = ' ("\\n" call)*' if request.parallel_tool_calls else ""
        lark = f"%llguidance {{}}\nstart: call{repeat}\ncall: {' '.join(call)}\n"
    return llguidance.LLMatcher.grammar_from_lark(lark), "tools"


def _call_rule(tools: list[Function], special_tags: bool) -> tuple[str, str]:
    """A call's opening tag, and the rest of it (JSON, closing tag)."""
    opening, closing = (
        (TOOL_OPEN, TOOL_CLOSE)
        if special_tags
        else (json.dumps(TOOL_OPEN), json.dumps(TOOL_CLOSE))
    )
    schema = json.dumps(call_schema(tools))
    return opening, f'"\\n" %json {schema} "\\n" {closing}'


class Grammars:
    """A model's constraint machinery: its llguidance tokenizer (built on
    first use: about a second for a large vocabulary), its compiled grammars
    and the token masks of its slots."""

    def __init__(
        self,
        make_tokenizer: Callable[[], "llguidance.LLTokenizer"],
        *,
        n_slots: int,
        n_vocab: int,
    ) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.n_vocab = n_vocab
        self._bits: np.ndarray | None = None
        self._n_slots = n_slots
        self._executor: llguidance.LLExecutor | None = None
        self._special_tags: bool | None = None
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="masks")

    @property
    def tokenizer(self) -> "llguidance.LLTokenizer":
        return self.load()

    def load(self) -> "llguidance.LLTokenizer":
        """The tokenizer, built with the slots' mask buffer on first use
        (blocking: about a second for a large vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                tokenizer = self._make_tokenizer()
                width = max(self.n_vocab, tokenizer.vocab_size)
                self._bits = np.full(
                    (self._n_slots, (width + 31) // 32), -1, dtype=np.int32
                )
                self._executor = llguidance.LLExecutor(1)
                self._tokenizer = tokenizer
            return self._tokenizer

    def special_tags(self) -> bool:
        """Whether the tool-call tags are special tokens of this vocabulary
        (read once)."""
        if self._special_tags is None:
            tokenizer = self.tokenizer
            self._special_tags = all(
                len(ids) == 1 and tokenizer.is_special_token(ids[0])
                for ids in (
                    tokenizer.tokenize_str(tag, parse_special=True)
                    for tag in (TOOL_OPEN, TOOL_CLOSE)
                )
            )
        return self._special_tags

    def matcher_for(self, request: GenerateRequest) -> Any:
        """A fresh matcher for the request's answer, or None for free text;
        bad_request naming what the grammar library refused (a schema feature
        it does not support, a bad pattern). Blocking (compiles on first
        use): run it off the event loop and the decode thread."""
        if not request.constrained:
            return None
        special = request.offers_tools and self.special_tags()
        built = grammar_for(request, special_tags=special)
        if built is None:
            return None
        grammar, where = built
        with self._lock:
            cached = self._compiled.get(grammar)
            if cached is not None:
                self._compiled.move_to_end(grammar)
        if cached is None:
            cached = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if cached.is_error():
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"{where}: refused by the grammar engine (llguidance): "
                    f"{cached.get_error()}",
                )
            with self._lock:
                self._compiled[grammar] = cached
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return cached.deep_copy()

    # -- masks (the decode thread) ---------------------------------------------

    def start_masks(self, rows: list[tuple[Any, int]]) -> Future | None:
        """Compute the allowed-token masks of these (matcher, slot index)
        pairs in the helper thread; wait on the returned future before
        applying them."""
        if not rows or self._bits is None:  # no matcher without the tokenizer
            return None
        return self._helper.submit(
            fill_next_token_bitmask_par, self._executor, rows, self._bits
        )

    def allowed(self, row: int) -> np.ndarray:
        """The mask of a slot as one bool per vocabulary entry."""
        bits = np.unpackbits(self._bits[row].view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def close(self) -> None:
        self._helper.shutdown(wait=False)
