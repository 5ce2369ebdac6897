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
cached per model: a request starts from a copy of the cached matcher.

Bounds: the request's own caps (engines/wire/requests.py) bound the
schemas; llguidance's limits (GRAMMAR_LIMITS) bound a grammar's compile and
each mask step, and a grammar past them is refused (bad_request) or fails
its request. The decode thread waits for the masks at most MASK_BUDGET_S,
and a slot whose mask was late or took longer fails alone: the other slots'
pass goes on."""

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from engines.constrained.toolcalls import TOOL_CLOSE, TOOL_OPEN
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.requests import Function, GenerateRequest, NamedTool

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
# llguidance's limits, set here rather than left to its defaults. Measured on
# SmolLM2's vocabulary: 128 tools of 60 integer arguments each (220 Ki
# characters, near MAX_TOOLS_CHARS) need a grammar size of 55k and compile in
# ~0.4 s; a 64 KiB schema of 2500 properties 20k. The fuel is llguidance's
# own measure of work (~50k/ms at compile, ~14k/ms lexing in a mask step,
# ~20k Earley items/ms): about 20 ms to compile the lexer, 14 + 2.5 ms per
# mask. A lexer state costs 1-2 KiB: 50k of them bound a grammar's lexer to
# ~100 MiB (llguidance's default, 250k, to ~500 MiB, per cached grammar).
GRAMMAR_LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=100_000,
)
# The longest the decode thread waits for a pass's masks, and the longest one
# slot's mask may take: past it that slot's request fails (bad_request) and
# the pass goes on without it. Masks take well under a millisecond and the
# limits above bound a step to ~20 ms; this is the last line (a slow machine,
# a vocabulary walk the fuel does not count), generous against a descheduled
# helper thread on a loaded host.
MASK_BUDGET_S = 1.0


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


@dataclass
class MaskJob:
    """A pass's masks being computed: the slots' rows, and how long each row
    took once done (written by the helper thread)."""

    rows: list[int]
    took: dict[int, float] = field(default_factory=dict)
    future: Future = field(init=False)


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
        limits: dict[str, int] | None = None,
        mask_budget_s: float = MASK_BUDGET_S,
    ) -> None:
        self.limits = dict(GRAMMAR_LIMITS if limits is None else limits)
        self.mask_budget_s = mask_budget_s
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.n_vocab = n_vocab
        self._bits: np.ndarray | None = None
        self._n_slots = n_slots
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
            cached = llguidance.LLMatcher(
                self.tokenizer,
                grammar,
                log_level=0,
                limits=llguidance.LLParserLimits(**self.limits),
            )
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

    def start_masks(self, rows: list[tuple[Any, int]]) -> MaskJob | None:
        """Compute the allowed-token masks of these (matcher, slot index)
        pairs in the helper thread, one after the other, timing each; pass
        the job to `late_masks` before applying them."""
        if not rows or self._bits is None:  # no matcher without the tokenizer
            return None
        bits = self._bits
        job = MaskJob([row for _, row in rows])

        def compute() -> None:
            for matcher, row in rows:
                start = time.perf_counter()
                fill_next_token_bitmask(matcher, bits, row)
                job.took[row] = time.perf_counter() - start

        job.future = self._helper.submit(compute)
        return job

    def late_masks(self, job: MaskJob) -> dict[int, str]:
        """Wait for a job's masks, up to the budget; the rows whose mask was
        not ready then, or took longer, each with what happened. A late job
        is left to finish on its own, into a buffer no longer read: the
        masks that were ready are carried into a fresh one, and later jobs
        run in a fresh helper thread."""
        budget = self.mask_budget_s
        try:
            job.future.result(timeout=budget)
        except FutureTimeout:
            done = dict(job.took)  # these rows are written: copied below
            log.warning("grammar masks not ready in %g s: slots fail", budget)
            self._bits = self._bits.copy()
            self._helper.shutdown(wait=False)
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="masks")
        else:
            done = job.took
        late = {}
        for row in job.rows:
            took = done.get(row)
            if took is None:
                late[row] = f"was not ready in {budget:g} s"
            elif took > budget:
                late[row] = f"took {took:.3g} s, over the budget of {budget:g} s"
        return late

    def allowed(self, row: int) -> np.ndarray:
        """The mask of a slot as one bool per vocabulary entry."""
        bits = np.unpackbits(self._bits[row].view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def close(self) -> None:
        self._helper.shutdown(wait=False)
