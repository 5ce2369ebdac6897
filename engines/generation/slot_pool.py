"""Slot bookkeeping shared by the generation backends: a model's sessions,
admission into a free one, the end conditions of a request (EOS, stop string,
max_tokens, context), its text/usage events, cancel and release. The backends
(engines/backends/) decode; engines/generation/runner.py runs them.

Prompt caching (which slot a request takes, prefixes copied between slots):
the PrefixSharing each backend holds (engines/generation/prefix_sharing.py).

KV groups: a backend may split its slots into `kv_groups` groups, each with
its own share of the KV pool (llama.cpp: one context per group); the pool's
room is counted per group."""

import abc
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engines.constrained.grammar import Grammars, MaskJob
from engines.constrained.toolcalls import ToolCallStream
from engines.generation.prefix_sharing import PrefixSharing
from engines.generation.prompts import OfferedTools, offered_tools, render_prompt
from engines.generation.runner import (
    GenerationBackend,
    GenerationRequest,
    describe_error,
)
from engines.generation.sampling import TextStream
from engines.generation.slot import Slot
from engines.wire.errors import ErrorCode

log = logging.getLogger("roundhouse.engine.generation")

# A backend's context when none is given (engines/backends/memory.py plans one for
# every model an engine loads).
DEFAULT_CONTEXT = 2048
# Batch requests (Batch API lines) yield to interactive ones. While an
# interactive prompt is read they sit out; while interactive requests are
# about (one in a slot, or one seen in the last INTERACTIVE_WINDOW_S) they
# take at most BATCH_TOKENS_BESIDE_LIVE tokens of a pass, in turns. A request
# that arrives waits for the pass under way, and on a 2-core CPU a token
# costs ~2.5 ms of a pass: a full batch pass (16 lines decoding, a new line's
# prompt) held a new prompt back ~65 ms on average (bench/batch.py: live time
# to first token 1.8x the idle one), a pass capped at 8 batch tokens 1.4x,
# at 4 tokens 1.04x. Batch throughput with no interactive request about is
# not capped.
BATCH_TOKENS_BESIDE_LIVE = 4
INTERACTIVE_WINDOW_S = 2.0


class SlotBackend(GenerationBackend):
    """Slot bookkeeping shared by the backends: admission into a free slot, the
    end conditions of a request (EOS, stop string, max_tokens, context), the
    text/usage events, cancel and release. Subclasses decode."""

    slots: list[Slot]
    ctx_per_slot: int  # the tokens one request may hold, prompt and answer
    pool_tokens: int  # the KV the slots hold together (their caches included)
    _admissions: int = 0
    # Whether _copy_prefix can share a slot's KV with another slot, and with
    # one in another KV group.
    copies_prefix: bool = False
    copies_across_groups: bool = False
    _prefix_sharing: PrefixSharing | None = None
    # The groups the slots are split over, each with an equal share of the pool.
    kv_groups: int = 1
    # Passes so far, and when an interactive request was last in a slot.
    _passes: int = 0
    _interactive_at: float = -float("inf")
    chat_template: str = ""
    bos_text: str = ""
    eos_text: str = ""

    def size_context(
        self, context_length: int | None, trained: int | None, pool_tokens: int | None
    ) -> None:
        """Set the context one request may hold (the setting, else
        DEFAULT_CONTEXT; never past what the model was trained on) and the KV
        pool the slots share (at least one context; else every slot's)."""
        self.ctx_per_slot = min(context_length or DEFAULT_CONTEXT, trained or 2**31)
        self.pool_tokens = max(
            self.ctx_per_slot, pool_tokens or self.ctx_per_slot * self.n_slots
        )

    @property
    def prefix_sharing(self) -> PrefixSharing:
        """The model's prompt cache over its slots (made on first use, with
        this backend's KV groups and _copy_prefix)."""
        if self._prefix_sharing is None:
            self._prefix_sharing = PrefixSharing(
                group_of=self.group_of,
                copy=self._copy_prefix if self.copies_prefix else None,
                across_groups=self.copies_across_groups,
            )
        return self._prefix_sharing

    @property
    def prompt_cache(self) -> bool:
        """Whether slots keep their KV between requests (the model's
        `prompt_cache`; the engine changes it live)."""
        return self.prefix_sharing.enabled

    @prompt_cache.setter
    def prompt_cache(self, enabled: bool) -> None:
        self.prefix_sharing.enabled = enabled

    @property
    def copied_tokens(self) -> int:
        """Prompt tokens copied from a slot in use instead of evaluated."""
        return self.prefix_sharing.copied_tokens

    def settle_awaiting(self) -> None:
        """Copy the prefixes slots wait for, once read (PrefixSharing); run
        before a step."""
        self.prefix_sharing.settle_awaiting(self.slots, self.fail)

    def group_of(self, slot: Slot) -> int:
        """The KV group of a slot (contiguous runs of slots, sizes within one)."""
        return slot.index * self.kv_groups // self.n_slots

    def stepping(self) -> tuple[list[Slot], dict[int, int]]:
        """The slots with a request that take part in the next pass, and the
        most prompt tokens each batch slot among them may read in it (by slot
        index; others: no cap). Not slots waiting for a prefix another slot
        reads. Batch requests yield to interactive ones: none while an
        interactive prompt is read, and BATCH_TOKENS_BESIDE_LIVE tokens in
        all, in turns, while interactive requests are about."""
        self._passes += 1
        active = [s for s in self.slots if s.request is not None and s.awaiting is None]
        live = [s for s in active if not s.request.background]
        now = time.monotonic()
        if live:
            self._interactive_at = now
        chosen, caps = active, {}
        if any(s.todo for s in live):
            chosen = live
        elif now - self._interactive_at < INTERACTIVE_WINDOW_S:
            chosen, budget = list(live), BATCH_TOKENS_BESIDE_LIVE
            waiting = [s for s in active if s.request.background]
            for slot in sorted(waiting, key=lambda s: s.stepped):
                if budget <= 0:
                    break
                if slot.todo:
                    caps[slot.index] = budget
                    budget -= min(len(slot.todo), budget)
                else:
                    budget -= 1
                chosen.append(slot)
        for slot in chosen:
            slot.stepped = self._passes
        return chosen, caps

    def group_pool(self) -> int:
        """The KV tokens each group's slots hold together."""
        return self.pool_tokens // self.kv_groups

    def render_prompt(
        self, message: dict[str, Any], *, tools: OfferedTools | None = None
    ) -> str:
        return render_prompt(
            message,
            template=self.chat_template,
            bos_text=self.bos_text,
            eos_text=self.eos_text,
            tools=tools,
        )

    def offered_tools(self, message: dict[str, Any]) -> OfferedTools:
        """The request's tools as this model's prompt offers them (made once
        for every render of the request)."""
        return offered_tools(message, template=self.chat_template)

    # -- hooks --------------------------------------------------------------------

    @abc.abstractmethod
    def _open(self, slot: Slot) -> None:
        """Create the slot's private state for its new request."""

    @abc.abstractmethod
    def _close(self, slot: Slot) -> None:
        """Drop the request's private state (the sampler); the KV stays."""

    @abc.abstractmethod
    def _keep(self, slot: Slot, count: int) -> int:
        """Keep the KV of the slot's first `count` tokens, drop the rest; how
        many were kept (0 where the KV cannot be cut there: all dropped)."""

    @abc.abstractmethod
    def _is_end(self, token: int) -> bool:
        """Whether a token ends generation (end of sequence / turn)."""

    @abc.abstractmethod
    def _text_of(self, slot: Slot, token: int) -> str:
        """The new text this token adds to the slot's output."""

    @abc.abstractmethod
    def token_bytes(self, token: int) -> bytes:
        """A token's bytes as the model writes it (a special token: its name);
        what log-probabilities report for it."""

    @abc.abstractmethod
    def detokenize(self, tokens: list[int]) -> str:
        """The text of these tokens (special ones left out)."""

    @abc.abstractmethod
    def vocabulary_size(self) -> int:
        """The token ids this model knows: 0 up to this."""

    @abc.abstractmethod
    def _make_grammar_tokenizer(self) -> Any:
        """The model's vocabulary as llguidance reads it
        (engines/constrained/grammar.py)."""

    def _copy_prefix(self, source: Slot, target: Slot, count: int) -> int:
        """Make the target's KV the source's first `count` tokens (the target's
        own dropped; both in one KV group unless copies_across_groups); how
        many were copied. Backends that cannot share KV between slots
        (copies_prefix False) copy nothing."""
        return 0

    # -- constraints -------------------------------------------------------------------

    # Whether log-probabilities read token bytes from the grammar tokenizer
    # (built on first use: off the decode thread, see engines/runtime/streaming.py).
    logprobs_need_grammar_tokenizer: bool = False

    _grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """The model's grammar machinery (made on first use)."""
        if self._grammars is None:
            self._grammars = Grammars(
                self._make_grammar_tokenizer,
                n_slots=self.n_slots,
                n_vocab=self.vocabulary_size(),
            )
        return self._grammars

    def start_masks(self, sampling: list[Slot]) -> MaskJob | None:
        """Start computing the allowed tokens of the constrained slots among
        those that sample after this pass (run while the pass runs)."""
        rows = [(s.matcher, s.index) for s in sampling if s.matcher is not None]
        return self.grammars.start_masks(rows) if rows else None

    def finish_masks(self, job: MaskJob | None) -> None:
        """Wait for the masks (up to their budget) before sampling; a slot
        whose mask was late fails alone, bad_request (its grammar is too
        costly), and the others sample."""
        if job is None:
            return
        for index, why in self.grammars.late_masks(job).items():
            slot = self.slots[index]
            if slot.request is not None:
                self.fail(
                    slot,
                    f"the answer's grammar: its next-token mask {why}",
                    ErrorCode.BAD_REQUEST.value,
                )

    def logprob_entry(self, logits: np.ndarray, token: int, top: int) -> dict:
        """The chosen token's log-probability (of the raw logits, before any
        sampling transform or grammar) and the `top` likeliest tokens', in
        OpenAI's shape: token text, its UTF-8 bytes, log-probability.
        `logits`: a 1-D float32 array of the raw logits, read not changed.

        On the decode thread, for every slot that asks, each token: one pass
        for the log-sum-exp (float32 terms, a float64 sum) and a partial
        selection of the `top` (argpartition), not a float64 log-softmax and
        a sort of the whole vocabulary: ~0.1 ms a token for SmolLM2's 49k
        entries instead of ~1 ms (bench/structured.py's logprobs phase)."""
        peak = float(logits.max())
        total = float(np.exp(logits - peak).sum(dtype=np.float64))
        normaliser = peak + math.log(total)
        entry = self._token_entry(token, float(logits[token]) - normaliser)
        entry["top_logprobs"] = []
        if top:
            best = np.argpartition(logits, -top)[-top:]
            best = best[np.argsort(-logits[best], kind="stable")]
            entry["top_logprobs"] = [
                self._token_entry(int(t), float(logits[t]) - normaliser) for t in best
            ]
        return entry

    def prompt_entry(self, logits: np.ndarray | None, token: int, top: int) -> dict:
        """A prompt token's entry: its text as the echoed prompt spells it
        (a special token: none), its log-probability given the tokens before
        it (the first token: None) and the `top` likeliest there."""
        text = self.detokenize([token])
        if logits is None:
            return {"token": text, "logprob": None, "bytes": [], "top_logprobs": []}
        entry = self.logprob_entry(logits, token, top)
        entry.update(token=text, bytes=list(text.encode("utf-8")))
        return entry

    def read_prompt_rows(self, slot: Slot, rows: list[tuple[int, Any]]) -> None:
        """Record the prompt's log-probabilities from a pass: (the position of
        a prompt token, the raw logits of its row) for each token the pass
        read; a row gives the next prompt token's entry."""
        prompt = slot.request.prompt_tokens
        top = slot.request.params.top_logprobs
        for position, logits in rows:
            if position + 1 < len(prompt):
                entry = self.prompt_entry(logits, prompt[position + 1], top)
                slot.prompt_entries.append(entry)

    def _token_entry(self, token: int, logprob: float) -> dict:
        data = self.token_bytes(token)
        return {
            "token": data.decode("utf-8", "replace"),
            # Rounding can leave a certain token's a hair above 0.
            "logprob": min(0.0, max(logprob, -9999.0)),
            "bytes": list(data),
        }

    # -- shared ------------------------------------------------------------------------

    def free_slots(self) -> int:
        return sum(slot.request is None for slot in self.slots)

    def active(self) -> int:
        return len(self.slots) - self.free_slots()

    def running_ids(self) -> set[str]:
        return {slot.request.id for slot in self.slots if slot.request is not None}

    def admit(self, request: GenerationRequest) -> None:
        if len(request.prompt_tokens) >= self.ctx_per_slot - 1:
            request.finish(
                {
                    "event": "error",
                    "code": ErrorCode.CONTEXT_LENGTH_EXCEEDED.value,
                    "message": f"the prompt has {len(request.prompt_tokens)} tokens; "
                    f"this model's context holds {self.ctx_per_slot}",
                }
            )
            return
        prompt = request.prompt_tokens
        sharing = self.prefix_sharing
        # A prompt whose log-probabilities are asked for is read whole.
        choice = sharing.choose(
            self.slots, prompt, whole=request.prompt_logprobs, salt=request.cache_salt
        )
        slot, donor = choice.slot, choice.donor
        # At least the prompt's last token is evaluated: its logits give the
        # first token.
        keep = min(choice.shared, len(prompt) - 1)
        lend = min(choice.lent, len(prompt) - 1)
        # A slot in use may hold a longer prefix (a common system prompt):
        # copied where the backend can, instead of evaluated again; one still
        # reading it is waited for.
        ready = lend > keep and len(donor.tokens) >= lend
        try:
            copied = sharing.copy(donor, slot, lend, prompt) if ready else 0
            keep = copied if copied else self._keep(slot, keep)
        except BaseException:
            self._forget(slot)
            raise
        del slot.tokens[keep:]
        if lend > keep and not ready:
            slot.awaiting = (donor, donor.request, lend)
        self._admissions += 1
        slot.used_at = self._admissions
        slot.request = request
        slot.salt = request.cache_salt
        slot.todo = list(prompt[keep:])
        slot.n_past = slot.cached = keep
        slot.generated = slot.unsent_tokens = 0
        slot.next_token = None
        slot.unsent_logprobs = []
        slot.stream = TextStream(stop=request.params.stop)
        slot.matcher = request.matcher
        slot.calls = ToolCallStream() if request.tool_calls else None
        slot.prompt_entries = None
        if request.prompt_logprobs:
            slot.prompt_entries = [self.prompt_entry(None, prompt[0], 0)]
        try:
            self._open(slot)
        except BaseException:
            slot.request = None  # the slot stays free; the caller answers the error
            slot.todo = []
            raise

    def pass_room(self, running: list[Slot], wanted: int, group: int = 0) -> int:
        """Room in a KV group's pool for this pass: each of its running slots'
        next token, and up to `wanted` prompt tokens; how many prompt tokens
        fit. Idle slots' caches go first, least recently used first. Where the
        requests in slots leave no room to move (the running ones' next tokens,
        or any prompt token while none runs), the newest admitted fails
        (overloaded: the caller may retry) and frees its room, so the older
        ones go on."""
        members = [s for s in self.slots if self.group_of(s) == group]
        need = len(running) + wanted
        free = self.group_pool() - sum(len(slot.tokens) for slot in members)
        if free < need:
            idle = [s for s in members if s.request is None and s.tokens]
            for slot in sorted(idle, key=lambda s: s.used_at):
                free += len(slot.tokens)
                self._forget(slot)
                if free >= need:
                    break
        active = [s for s in members if s.request is not None]

        def stuck() -> bool:
            # No room for the running slots' next tokens, or for any prompt
            # token while nothing runs: nothing could move.
            return free < len(running) or (
                not running and wanted and free <= 0 and len(active) > 1
            )

        while active and stuck():
            newest = max(active, key=lambda s: s.used_at)
            active.remove(newest)
            if newest in running:
                running.remove(newest)
            free += len(newest.tokens)
            self.fail(newest, self._pool_full(), ErrorCode.OVERLOADED.value)
        return max(0, min(wanted, free - len(running)))

    def _pool_full(self) -> str:
        share = f" (its {self.kv_groups} groups' share)" if self.kv_groups > 1 else ""
        return (
            f"the model's KV pool ({self.group_pool()} tokens{share}) is full "
            "with the other requests' conversations: try again shortly"
        )

    def _forget(self, slot: Slot) -> None:
        """Drop the slot's whole cache (its KV may not match `tokens`)."""
        del slot.tokens[:]
        try:
            self._keep(slot, 0)
        except Exception:
            log.exception("clearing the cache of slot %d failed", slot.index)

    def sample_each(
        self, outputs: list[tuple[Slot, Any]], sample: Callable[[Slot, Any], None]
    ) -> None:
        """Run `sample(slot, where)` for each slot that produced logits; one that
        raises (NaN or inf logits, a sampler error) fails its own request only."""
        for slot, where in outputs:
            if slot.request is None:
                continue
            try:
                sample(slot, where)
            except Exception as error:
                log.warning("sampling %s failed: %r", slot.request.id, error)
                self.fail(slot, f"sampling failed: {describe_error(error)}")

    def accept(self, slot: Slot, token: int, logprob: dict | None = None) -> None:
        """Take a sampled token: end the request, or queue it for the next step.
        A grammar's matcher takes it first; an answer its grammar completes
        ends there (nothing else could follow)."""
        params = slot.request.params
        matcher = slot.matcher
        if matcher is not None and not matcher.consume_token(token):
            self.fail(slot, f"the answer left its grammar: {matcher.get_error()}")
            return
        if (not params.ignore_eos or matcher is not None) and self._is_end(token):
            self.finish(slot, "stop")
            return
        slot.generated += 1
        slot.unsent_tokens += 1
        if logprob is not None:
            slot.unsent_logprobs.append(logprob)
        text = slot.stream.feed_text(self._text_of(slot, token))
        if text:
            self._emit_text(slot, text)
        if slot.stream.stopped or (matcher is not None and matcher.is_stopped()):
            self.finish(slot, "stop")
        elif (
            slot.generated >= params.max_tokens or slot.n_past + 1 >= self.ctx_per_slot
        ):
            self.finish(slot, "length")
        else:
            slot.next_token = token

    def _emit_text(self, slot: Slot, text: str, *, last: bool = False) -> None:
        """Send a text chunk with the count (and log-probs) of its tokens, and
        the tool-call deltas read from it."""
        calls: list[dict] = []
        if slot.calls is not None:
            text, calls = slot.calls.feed(text)
            if last:
                tail, more = slot.calls.finish()
                text, calls = text + tail, calls + more
        if not (text or calls or slot.unsent_tokens or slot.prompt_entries):
            return
        event = {"event": "token", "text": text, "tokens": slot.unsent_tokens}
        if slot.prompt_entries:  # with the answer's first text
            event["prompt_logprobs"] = slot.prompt_entries
            slot.prompt_entries = None
        if calls:
            event["tool_calls"] = calls
        if slot.unsent_logprobs:
            event["logprobs"] = slot.unsent_logprobs
        slot.request.emit(event)
        slot.unsent_tokens = 0
        slot.unsent_logprobs = []

    def finish(self, slot: Slot, reason: str) -> None:
        """End the slot's request with a finish reason and free the slot; an
        answer that called tools ends with `tool_calls`."""
        request = slot.request
        if reason == "cancelled":
            self._emit_text(slot, "")  # the tokens made but not yet sent
        else:
            self._emit_text(slot, slot.stream.finish(), last=True)
        done = {
            "event": "done",
            "finish_reason": reason,
            "usage": {
                "prompt_tokens": len(request.prompt_tokens),
                "completion_tokens": slot.generated,
                "cached_tokens": slot.cached,
            },
        }
        if slot.stream.stopped_by is not None:  # Anthropic's `stop_sequence`
            done["stop_sequence"] = slot.stream.stopped_by
        if slot.calls is not None and slot.calls.calls:
            done["tool_calls"] = slot.calls.calls
            if reason == "stop":
                done["finish_reason"] = "tool_calls"
        request.finish(done)
        self.release(slot)

    def fail(self, slot: Slot, message: str, code: str = ErrorCode.INTERNAL) -> None:
        """End the slot's request with an error and free the slot, its cache
        dropped (a failed pass may have left its KV half written)."""
        if slot.request is not None:
            slot.request.finish({"event": "error", "code": code, "message": message})
        self.release(slot)
        self._forget(slot)

    def fail_running(self, code: str, message: str) -> None:
        for slot in self.slots:
            if slot.request is not None:
                self.fail(slot, message, code)

    def release(self, slot: Slot) -> None:
        try:
            self._close(slot)
        except Exception:  # the slot is reused all the same; its state is reset
            log.exception("clearing slot %d failed", slot.index)
        slot.request = slot.next_token = slot.state = slot.awaiting = None
        slot.matcher = slot.calls = slot.prompt_entries = None
        slot.todo = []

    def cancel(self, request_id: str) -> bool:
        for slot in self.slots:
            if slot.request is not None and slot.request.id == request_id:
                self.finish(slot, "cancelled")
                return True
        return False

    def cancel_all(self) -> None:
        for slot in self.slots:
            if slot.request is not None:
                self.finish(slot, "cancelled")
