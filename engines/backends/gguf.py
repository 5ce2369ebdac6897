"""GGUF models through llama.cpp's low-level API (llama-cpp-python's ctypes
bindings), with continuous batching: one sequence id per slot, and every active
slot's next token in one llama_decode per KV group.

KV groups: the slots are split over `kv_groups` llama.cpp contexts sharing the
weights, each with a unified KV cache for its slots (a conversation may hold
up to its context, more than an equal share). llama.cpp's attention scans
every cell in use in a context, a conversation's own or not: with 32
conversations of ~900 tokens in one context each token costs ~3.5x what it
costs alone; in four contexts each token scans a quarter of the cells, for one
more decode call per group and step.

KV streams: where the pool holds every slot's whole context
(memory.SlotPlan.kv_streams), one context with a KV stream per slot
(llama.cpp's kv_unified off): a token's attention scans its own
conversation's cells alone, and a step is one decode call."""

import ctypes
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llguidance.llamacpp import lltokenizer_from_vocab

from engines.backends.llama import init_llama_cpp
from engines.backends.memory import BATCH_TOKENS
from engines.backends.offload import OffloadPlan
from engines.generation.sampling import SamplingParams
from engines.generation.slot import Slot
from engines.generation.slot_pool import SlotBackend
from engines.launch.config import usable_cores
from engines.wire.errors import ErrorCode, ProtocolError

log = logging.getLogger("roundhouse.engine.gguf")

# Prompt tokens evaluated per step across all slots (memory.BATCH_TOKENS: the
# estimates size llama.cpp's compute buffer with it). A long prompt is fed in
# chunks of this size, so running streams wait at most one chunk per token.
# Prompt tokens read per pass for a request that asks for its prompt's
# log-probabilities: each keeps its row of logits (llama.cpp's output buffer
# holds them: 32 rows of SmolLM2's 49,152 logits are 6 MiB).
SCORED_TOKENS = 32
# Repeat/frequency/presence penalties look at this many previous tokens.
PENALTY_WINDOW = 64
# Prompt tokens a step reads while it has company: streams running, or other
# prompts waiting. A prompt alone takes whole BATCH_TOKENS chunks. When many
# turns arrive at once (32 people chatting, their turns bunched), all of them
# in one step would give every first token at the end of that long step; in
# short steps, oldest first, the first ones leave early (bench/chat.py, with
# a KV stream per slot as well: turn 2's p50 first token 1.1 s, 2.8 s
# before; bench/README.md). Running streams meanwhile get a token every
# short step; a long prompt beside them takes ~20% longer to read (the
# streams' tokens ride in more steps).
PROMPT_TOKENS_SHARED = 128


def _penalised(params: SamplingParams) -> bool:
    return bool(
        params.repeat_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
    )


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy sampling with no penalty: nothing for a sampler chain to do
    but take the highest logit."""
    return params.temperature <= 0 and not _penalised(params)


@dataclass
class _Group:
    """One llama.cpp context: a KV group's slots (sequence id = the slot's
    index less `first`) and the batch built for it each step."""

    ctx: Any
    memory: Any
    batch: Any
    first: int
    # This step's slots with logits: (slot, batch row), first tokens, then
    # running ones; and slots that read a prompt chunk with more to come.
    firsts: list = field(default_factory=list)
    running: list = field(default_factory=list)
    reading: list = field(default_factory=list)
    # Prompt tokens whose rows give their prompt's log-probabilities:
    # (slot, batch row, position).
    scored: list = field(default_factory=list)


class LlamaBackend(SlotBackend):
    """A GGUF model with `n_slots` sessions over `kv_groups` llama.cpp
    contexts."""

    copies_prefix = True
    copies_across_groups = True

    def __init__(
        self,
        path: Path | str,
        *,
        n_slots: int,
        context_length: int | None = None,
        n_threads: int | None = None,
        offload: OffloadPlan | None = None,
        chat_template: str = "",
        prompt_cache: bool = True,
        pool_tokens: int | None = None,
        kv_groups: int = 1,
        kv_streams: bool = False,
    ) -> None:
        init_llama_cpp()
        self.n_slots = n_slots
        self.kv_streams = kv_streams and n_slots > 1
        self.kv_groups = 1 if self.kv_streams else max(1, min(kv_groups, n_slots))
        self.prompt_cache = prompt_cache
        self.model = None
        self.groups: list[_Group] = []
        self.slots: list[Slot] = []
        # Where the layers go (engines/backends/offload.py); none: the CPU.
        self.offload = offload or OffloadPlan(0, 0)
        try:
            self._create(path, context_length, n_threads, chat_template, pool_tokens)
        except Exception:
            self.close()  # release whatever was created before the failure
            raise

    def _create(
        self, path, context_length, n_threads, chat_template, pool_tokens
    ) -> None:
        params = self._model_params()
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode("utf-8"), params
        )
        if not self.model:
            raise ProtocolError(ErrorCode.INTERNAL, f"llama.cpp cannot load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        trained = llama_cpp.llama_model_n_ctx_train(self.model)
        self.size_context(context_length, trained, pool_tokens)
        if self.kv_streams:  # every slot's stream holds its whole context
            self.pool_tokens = self.ctx_per_slot * self.n_slots
        self.slots = [Slot(index=index) for index in range(self.n_slots)]
        threads = n_threads or usable_cores()
        for group in range(self.kv_groups):
            members = [s for s in self.slots if self.group_of(s) == group]
            cparams = llama_cpp.llama_context_default_params()
            # The group's KV, unified: a sequence may hold up to its context,
            # more than an equal share of the pool. With KV streams, each
            # sequence's own stream of the pool's equal share (its context).
            cparams.n_ctx = self.group_pool()
            cparams.n_batch = cparams.n_ubatch = BATCH_TOKENS
            cparams.n_seq_max = len(members)
            cparams.n_threads = cparams.n_threads_batch = threads
            cparams.kv_unified = not self.kv_streams
            cparams.no_perf = True
            ctx = llama_cpp.llama_init_from_model(self.model, cparams)
            if not ctx:
                raise ProtocolError(
                    ErrorCode.INSUFFICIENT_MEMORY,
                    f"cannot create a {cparams.n_ctx}-token context for {path}",
                )
            batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)
            self.groups.append(
                _Group(ctx, llama_cpp.llama_get_memory(ctx), batch, members[0].index)
            )
        own = llama_cpp.llama_model_chat_template(self.model, None)
        self.chat_template = chat_template or (own.decode("utf-8") if own else "")
        self.bos_text = self._token_text(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos_text = self._token_text(llama_cpp.llama_vocab_eos(self.vocab))

    def _model_params(self):
        """llama.cpp's model parameters for the offload plan: its layers on
        the cards (0: every layer on the CPU, whatever the build); over
        several cards split by layer in the plan's proportions (a float per
        device llama.cpp may have, kept alive on `self` while it loads);
        one card as the main one (the one with the most free memory). A CPU
        build takes them and runs everything on the CPU."""
        plan = self.offload
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = plan.n_gpu_layers
        split, params.main_gpu = plan.llama_split(llama_cpp.LLAMA_MAX_DEVICES)
        if len(plan.devices) > 1:
            params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
            self._tensor_split = (ctypes.c_float * len(split))(*split)
            params.tensor_split = self._tensor_split
        else:  # one card (main_gpu), or none
            params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_NONE
        return params

    # -- prompts -----------------------------------------------------------------

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = llama_cpp.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab)) and not (
            self.bos_text and text.startswith(self.bos_text)
        )
        capacity = len(data) + 8
        tokens = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(
            self.vocab, data, len(data), tokens, capacity, add_bos, True
        )
        if count < 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prompt cannot be tokenized")
        return list(tokens[:count])

    def _piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes (a special token's name only with `special`)."""
        buffer = ctypes.create_string_buffer(64)
        size = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, 64, 0, special)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = llama_cpp.llama_token_to_piece(
                self.vocab, token, buffer, -size, 0, special
            )
        return buffer.raw[:size]

    def token_bytes(self, token: int) -> bytes:
        return self._piece(token, special=True)

    def vocabulary_size(self) -> int:
        return self.n_vocab

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self._piece(t) for t in tokens).decode("utf-8", "replace")

    def _make_grammar_tokenizer(self):
        """llguidance's reading of this vocabulary; the end-of-generation
        tokens (end of text, end of turn) end a constrained answer."""
        ends = [
            token
            for token in (
                llama_cpp.llama_vocab_eos(self.vocab),
                llama_cpp.llama_vocab_eot(self.vocab),
            )
            if token >= 0
        ]
        return lltokenizer_from_vocab(
            self.vocab, n_vocab=self.n_vocab, eos_token=list(dict.fromkeys(ends))
        )

    # -- slots ---------------------------------------------------------------------

    def _open(self, slot: Slot) -> None:
        """The slot's sampler chain; none for greedy sampling with no
        penalty: its token is the row's argmax (_sample_at)."""
        params = slot.request.params
        slot.state = None if _plain_greedy(params) else self._sampler(params)

    def _close(self, slot: Slot) -> None:
        """Free the request's sampler; the slot's KV stays (its prompt cache)."""
        if slot.state is not None:
            llama_cpp.llama_sampler_free(slot.state)
            slot.state = None

    def _where(self, slot: Slot) -> tuple[_Group, int]:
        """The slot's group and its sequence id in the group's context."""
        group = self.groups[self.group_of(slot)]
        return group, slot.index - group.first

    def _keep(self, slot: Slot, count: int) -> int:
        """Cut the slot's sequence in the KV cache after `count` positions."""
        group, seq = self._where(slot)
        if count and llama_cpp.llama_memory_seq_rm(group.memory, seq, count, -1):
            return count
        llama_cpp.llama_memory_seq_rm(group.memory, seq, -1, -1)
        return 0

    def _copy_prefix(self, source: Slot, target: Slot, count: int) -> int:
        """Give the target the source sequence's first `count` positions. In
        one group (one context): llama.cpp's sequence copy, the unified KV
        cache's cells shared, not duplicated. Across groups: the source
        sequence's KV copied into the target's context (llama.cpp's sequence
        state, ~23 KiB a token for SmolLM2: a memory copy, not a pass of the
        model), then cut after `count`; 0 where that context has no room.
        Between KV streams (one context): as across groups."""
        group, to = self._where(target)
        source_group, origin = self._where(source)
        llama_cpp.llama_memory_seq_rm(group.memory, to, -1, -1)
        # Between KV streams llama.cpp copies whole streams only: the
        # sequence's state is copied instead, as across groups.
        if source_group is group and not self.kv_streams:
            llama_cpp.llama_memory_seq_cp(group.memory, origin, to, 0, count)
            return count
        size = llama_cpp.llama_state_seq_get_size(source_group.ctx, origin)
        state = (ctypes.c_uint8 * size)()
        size = llama_cpp.llama_state_seq_get_data(source_group.ctx, state, size, origin)
        if not size or not llama_cpp.llama_state_seq_set_data(
            group.ctx, state, size, to
        ):
            llama_cpp.llama_memory_seq_rm(group.memory, to, -1, -1)
            return 0
        llama_cpp.llama_memory_seq_rm(group.memory, to, count, -1)
        return count

    def _is_end(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def _text_of(self, slot: Slot, token: int) -> str:
        return slot.stream.decode_bytes(self._piece(token))

    def _sampler(self, params: SamplingParams):
        """llama.cpp's native sampler chain for one request (no Python loop over
        the vocabulary)."""
        chain = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params()
        )
        add = llama_cpp.llama_sampler_chain_add
        if _penalised(params):
            add(
                chain,
                llama_cpp.llama_sampler_init_penalties(
                    self.n_vocab,
                    PENALTY_WINDOW,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                ),
            )
        if params.temperature <= 0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0:
            add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
        add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else 0xFFFFFFFF  # random
        add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    # -- decoding --------------------------------------------------------------------

    @staticmethod
    def _add(group: _Group, token: int, pos: int, seq: int, logits: bool) -> int:
        batch = group.batch
        index = batch.n_tokens
        batch.token[index] = token
        batch.pos[index] = pos
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = seq - group.first
        batch.logits[index] = logits
        batch.n_tokens = index + 1
        return index

    def step(self) -> None:
        """Running slots add their last token; slots still reading their prompt
        fill the rest of the pass with prompt chunks; one llama_decode per KV
        group with tokens; then each slot that produced logits samples its next
        token."""
        self.settle_awaiting()
        # Slots waiting for a prefix another slot is reading read nothing yet;
        # batch requests yield to interactive ones (SlotBackend.stepping).
        active, caps = self.stepping()
        going = [s for s in active if s.next_token is not None]
        for group in self.groups:
            group.batch.n_tokens = 0
            group.firsts, group.running, group.reading = [], [], []
            group.scored = []
        # Each group's KV room: its running slots' tokens, then prompt chunks
        # (the pass takes at most BATCH_TOKENS in all; PROMPT_TOKENS_SHARED
        # of prompts when they have company).
        budget = BATCH_TOKENS - len(going)
        if going or sum(1 for s in active if s.todo) > 1:
            budget = min(budget, PROMPT_TOKENS_SHARED)
        room = []
        for number in range(self.kv_groups):
            mine = [s for s in going if self.group_of(s) == number]
            wanted = sum(
                min(len(s.todo), caps.get(s.index, BATCH_TOKENS))
                for s in active
                if self.group_of(s) == number
            )
            room.append(self.pass_room(mine, min(wanted, budget), number))
        for slot in going:
            if slot.request is None:  # failed for lack of room
                continue
            group = self.groups[self.group_of(slot)]
            index = self._add(group, slot.next_token, slot.n_past, slot.index, True)
            slot.tokens.append(slot.next_token)
            slot.n_past += 1
            slot.next_token = None
            group.running.append((slot, index))
        # Prompt chunks in admission order: the oldest prompt is read first, so
        # a prompt waits for those admitted before it, never for later ones.
        for slot in sorted(self.slots, key=lambda s: s.used_at):
            number = self.group_of(slot)
            group = self.groups[number]
            take = min(
                BATCH_TOKENS - group.batch.n_tokens,
                room[number],
                budget,
                caps.get(slot.index, BATCH_TOKENS),
            )
            if slot not in active or slot.request is None or not slot.todo:
                continue  # no request, waiting for a prefix, or prompt read
            if take <= 0:
                continue
            scoring = slot.prompt_entries is not None
            if scoring:  # every row's logits kept: a smaller chunk
                take = min(take, SCORED_TOKENS)
            chunk, slot.todo = slot.todo[:take], slot.todo[take:]
            room[number] -= len(chunk)
            budget -= len(chunk)
            slot.tokens.extend(chunk)
            for offset, token in enumerate(chunk):
                last = not slot.todo and offset == len(chunk) - 1
                index = self._add(
                    group, token, slot.n_past, slot.index, last or scoring
                )
                if scoring and not last:
                    group.scored.append((slot, index, slot.n_past))
                slot.n_past += 1
            if not slot.todo:
                group.firsts.append((slot, index))
            else:
                group.reading.append(slot)
        # Slots whose prompt ends in this pass are sampled first, the running
        # ones after: a first token then leaves ahead of the other streams' next
        # tokens, here and in every hop that relays them one by one (a stream's
        # user is waiting on its first token; a running stream's next token is
        # due no sooner than the next pass).
        # The constrained slots' allowed tokens are computed while the
        # model's passes run (engines/constrained/grammar.py).
        masks = self.start_masks(
            [
                slot
                for group in self.groups
                for slot, _ in [*group.firsts, *group.running]
            ]
        )
        firsts, running = [], []
        for group in self.groups:
            if group.batch.n_tokens == 0:
                continue
            code = llama_cpp.llama_decode(group.ctx, group.batch)
            outputs = [(slot, (group, index)) for slot, index in group.firsts]
            later = [(slot, (group, index)) for slot, index in group.running]
            if code != 0:
                # Every slot with tokens in the pass fails: its KV now lacks them.
                for slot, _ in [*outputs, *later]:
                    self.fail(slot, f"llama_decode returned {code}")
                for slot in group.reading:
                    self.fail(slot, f"llama_decode returned {code}")
                continue
            for slot, index, position in group.scored:
                if slot.request is not None:
                    rows = [(position, self._logprobs(group.ctx, index))]
                    self.read_prompt_rows(slot, rows)
            firsts += outputs
            running += later
        self.finish_masks(masks)
        self.sample_each(firsts + running, self._sample_at)

    def _sample_at(self, slot: Slot, where: tuple[_Group, int]) -> None:
        """Sample the slot's next token from its group's output row."""
        group, index = where
        params = slot.request.params
        pointer = llama_cpp.llama_get_logits_ith(group.ctx, index)
        logits = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        # The raw row's copy, for its log-probabilities: a grammar's mask
        # changes the row in place below.
        logprobs = logits.copy() if params.logprobs else None
        if slot.matcher is not None:
            # Only the tokens the grammar allows next (in place: the sampler
            # reads these logits).
            np.putmask(logits, ~self.grammars.allowed(slot.index), -np.inf)
        if slot.state is None:  # greedy: llama.cpp's greedy sampler's pick
            # (the first highest logit) without its copy of the vocabulary
            token = int(logits.argmax())
        else:
            token = llama_cpp.llama_sampler_sample(slot.state, group.ctx, index)
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"the sampler returned token {token}")
        # NaN or inf logits (a broken model, numerical overflow) let the sampler
        # pick anything: the chosen token's own logit tells, at the cost of one
        # read instead of a pass over the vocabulary.
        logit = logits[token]
        if not math.isfinite(logit):
            raise ValueError("the model produced non-finite logits (NaN or inf)")
        entry = None
        if logprobs is not None:
            entry = self.logprob_entry(logprobs, token, params.top_logprobs)
        self.accept(slot, token, entry)

    def _logprobs(self, ctx, index: int) -> np.ndarray:
        """A copy of an output row's raw logits (float32), for its
        log-probabilities (a prompt row's: llama.cpp's buffer is reused by
        the next pass)."""
        pointer = llama_cpp.llama_get_logits_ith(ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        self.cancel_all()
        self.slots = []
        if self._grammars is not None:
            self._grammars.close()
        for group in self.groups:
            llama_cpp.llama_batch_free(group.batch)
            llama_cpp.llama_free(group.ctx)
        self.groups = []
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None
