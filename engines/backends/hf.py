"""Causal language models through transformers (a local folder, or a GGUF file
dequantized by transformers), with continuous batching of our own: each slot
keeps its own KV cache; every step stacks the running slots' caches (left-padded
to a common length, masked) into one batched forward pass and splits the new
entries back. Prompts are prefilled alone, in chunks, between decode steps.

Where the weights go and in what precision is planned by
engines/backends/hf_placement.py: the CPU, one card, or sharded over the
engine's cards by accelerate's device map (offloading what they cannot hold).
Inputs go to the input embedding's device; each layer's KV stays on that
layer's device; sampling runs on the device the logits come out on."""

import gc
from pathlib import Path

import torch
from llguidance.hf import from_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engines.backends.hf_placement import (
    TORCH_GPU_BACKENDS,
    Card,
    Placement,
    plan_placement,
    read_checkpoint,
)
from engines.generation.sampling import SamplingParams
from engines.generation.slot import Slot
from engines.generation.slot_pool import SlotBackend

# Prompt tokens prefilled per step: bounds how long running streams wait.
PREFILL_CHUNK = 128


class _Kv:
    """A slot's private KV cache: per layer, keys and values [1, H, T, D]."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2] if self.layers else 0


class _SlotState:
    def __init__(self, params: SamplingParams, kv: _Kv) -> None:
        self.kv = kv  # the slot's: it outlives the request (the prompt cache)
        self.seed = params.seed
        self._generator: torch.Generator | None = None
        self.ids: list[int] = []  # generated so far, for penalties and detokenizing
        self.text = ""  # decoded text of `ids`

    def generator(self, device: torch.device) -> torch.Generator:
        """The request's random generator, made on the device its logits are
        on (torch samples only with a generator of the tensor's device)."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            if self.seed is not None:
                self._generator.manual_seed(self.seed)
            else:
                self._generator.seed()
        return self._generator


def torch_cards() -> list[Card]:
    """The cards torch sees (CUDA_VISIBLE_DEVICES applied), with their free
    memory now; bfloat16 from the compute capability (8.0 or later) on
    NVIDIA, on every card torch supports under ROCm."""
    cards = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        bf16 = bool(torch.version.hip) or properties.major >= 8
        cards.append(Card(index, properties.name, total / 2**20, free / 2**20, bf16))
    return cards


def penalized(
    logits: torch.Tensor, ids: list[int], params: SamplingParams
) -> torch.Tensor:
    """The logits after the repeat, frequency and presence penalties over the
    last 64 generated tokens, computed on the logits' device without reading
    them back (no boolean indexing)."""
    seen = torch.tensor(ids[-64:], dtype=torch.long, device=logits.device)
    counts = torch.zeros_like(logits).scatter_add_(
        0, seen, torch.ones_like(seen, dtype=logits.dtype)
    )
    present = counts > 0
    repeated = torch.where(
        logits > 0, logits / params.repeat_penalty, logits * params.repeat_penalty
    )
    logits = torch.where(present, repeated, logits)
    return logits - (
        counts * params.frequency_penalty + present * params.presence_penalty
    )


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, temperature, min-p and top-p: the probabilities to draw from
    (not normalized), on the logits' device."""
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
    if params.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        outside = ordered.cumsum(-1) - ordered > params.top_p
        ordered = ordered.masked_fill(outside, 0)
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    return probs


class TransformersBackend(SlotBackend):
    """A transformers causal LM with `n_slots` sessions sharing its weights."""

    _masks = None  # this step's grammar masks being computed
    logprobs_need_grammar_tokenizer = True  # token_bytes reads it

    def __init__(
        self,
        path: Path | str,
        *,
        n_slots: int,
        context_length: int | None = None,
        n_threads: int | None = None,
        device: str = "cpu",
        backend: str = "",
        dtype: str = "auto",
        max_gpu_percent: int = 90,
        cards: list[Card] | None = None,
        chat_template: str = "",
        prompt_cache: bool = True,
        pool_tokens: int | None = None,
    ) -> None:
        """`backend`: the engine's (engines/launch/config.py; empty: "cuda"
        for a cuda `device`, else "cpu"); `dtype` and `max_gpu_percent`: the
        model's settings; `cards`: the engine's cards (None: torch's now)."""
        self.n_slots = n_slots
        self.prompt_cache = prompt_cache
        if n_threads:
            torch.set_num_threads(n_threads)
        path = Path(path)
        source, extra = (
            (path.parent, {"gguf_file": path.name})
            if path.suffix == ".gguf"
            else (path, {})
        )
        self.tokenizer = AutoTokenizer.from_pretrained(
            source, local_files_only=True, **extra
        )
        backend = backend or ("cuda" if str(device).startswith("cuda") else "cpu")
        if cards is None:
            gpu = backend in TORCH_GPU_BACKENDS and torch.cuda.is_available()
            cards = torch_cards() if gpu else []
        checkpoint = read_checkpoint(path)
        self.placement: Placement = plan_placement(
            backend=backend,
            cards=cards,
            checkpoint=checkpoint,
            dtype=dtype,
            max_gpu_percent=max_gpu_percent,
            kv_tokens=pool_tokens or (context_length or 0) * n_slots,
        )
        self.model = AutoModelForCausalLM.from_pretrained(
            source, local_files_only=True, **self.placement.load_kwargs(), **extra
        )
        self.model.eval()
        # Under a device map the layers may sit on several devices: inputs
        # go where the input embedding is.
        self.device = self.model.get_input_embeddings().weight.device
        trained = getattr(self.model.config, "max_position_embeddings", None)
        # The KV the slots may hold together (each slot's own tensors here).
        self.size_context(context_length, trained, pool_tokens)
        self.chat_template = chat_template or (self.tokenizer.chat_template or "")
        self.bos_text = self.tokenizer.bos_token or ""
        self.eos_text = self.tokenizer.eos_token or ""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.end_tokens = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.slots = [Slot(index=index) for index in range(n_slots)]
        self._kvs = [_Kv() for _ in range(n_slots)]

    # -- prompts ---------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        return self.tokenizer(text, add_special_tokens=add_special)["input_ids"]

    # -- slot hooks ------------------------------------------------------------

    def _open(self, slot: Slot) -> None:
        slot.state = _SlotState(slot.request.params, self._kvs[slot.index])

    def _close(self, slot: Slot) -> None:
        pass  # the request's state goes with it; the slot's KV stays

    def _keep(self, slot: Slot, count: int) -> int:
        kv = self._kvs[slot.index]
        kv.layers = (
            [(k[..., :count, :], v[..., :count, :]) for k, v in kv.layers]
            if count
            else []
        )
        return count

    def _is_end(self, token: int) -> bool:
        return token in self.end_tokens

    def token_bytes(self, token: int) -> bytes:
        """From llguidance's reading of the tokenizer (byte-level and
        sentencepiece vocabularies alike); a special token: its name."""
        data = self.grammars.tokenizer.decode_bytes([token])
        if not data or data.startswith(b"\xff"):
            return self.tokenizer.convert_ids_to_tokens(token).encode("utf-8")
        return data

    def vocabulary_size(self) -> int:
        return int(self.model.config.vocab_size)

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _make_grammar_tokenizer(self):
        return from_tokenizer(
            self.tokenizer,
            n_vocab=self.vocabulary_size(),
            eos_token=sorted(self.end_tokens),
        )

    def _text_of(self, slot: Slot, token: int) -> str:
        state: _SlotState = slot.state
        state.ids.append(token)
        text = self.tokenizer.decode(state.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character still split across tokens
            return ""
        new, state.text = text[len(state.text) :], text
        return new

    # -- decoding --------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Prefill one chunk of one waiting prompt, then one batched decode step
        over every slot that has a token to feed."""
        # Batch requests yield to interactive ones (SlotBackend.stepping).
        active, caps = self.stepping()
        running = [s for s in active if s.next_token is not None]
        # The oldest admitted prompt first (FIFO), interactive ones before batch.
        prefilling = min(
            (s for s in active if s.todo),
            key=lambda s: (s.request.background, s.used_at),
            default=None,
        )
        wanted = 0
        if prefilling is not None:
            cap = caps.get(prefilling.index, PREFILL_CHUNK)
            wanted = min(len(prefilling.todo), PREFILL_CHUNK, cap)
        # The KV pool's room: the running slots' tokens, then a prompt chunk.
        room = self.pass_room(running, wanted)
        # The constrained slots' allowed tokens are computed while the
        # forward passes run (engines/constrained/grammar.py).
        sampling = list(running)
        if prefilling is not None and 0 < len(prefilling.todo) <= room:
            sampling.append(prefilling)
        self._masks = self.start_masks(sampling)
        if prefilling is not None and prefilling.request is not None and room:
            try:
                self._prefill(prefilling, room)
            except Exception as error:  # this prompt's failure is its own
                self.fail(prefilling, f"evaluating the prompt failed: {error!r}"[:300])
        if running:
            self._decode(running)

    def _forward(
        self,
        input_ids,
        kv_layers,
        attention_mask=None,
        position_ids=None,
        every_row: bool = False,
    ):
        """The last position's logits (every position's with `every_row`)
        and the new KV."""
        cache = DynamicCache(ddp_cache_data=kv_layers or None, config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            cache=cache,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
        )
        layers = [(layer.keys, layer.values) for layer in out.cache.layers]
        return (out.logits if every_row else out.logits[:, -1, :]), layers

    def _prefill(self, slot: Slot, size: int) -> None:
        state: _SlotState = slot.state
        chunk, slot.todo = slot.todo[:size], slot.todo[size:]
        slot.tokens.extend(chunk)
        start = state.kv.length
        ids = torch.tensor([chunk], device=self.device)
        positions = torch.arange(start, start + len(chunk), device=self.device)[None]
        mask = torch.ones((1, start + len(chunk)), dtype=torch.long, device=self.device)
        scoring = slot.prompt_entries is not None
        logits, state.kv.layers = self._forward(
            ids,
            state.kv.layers,
            attention_mask=mask,
            position_ids=positions,
            every_row=scoring,
        )
        if scoring:  # each row gives the next prompt token's log-probability
            rows = logits[0].float().cpu().numpy()
            self.read_prompt_rows(
                slot, [(start + offset, row) for offset, row in enumerate(rows)]
            )
            logits = logits[:, -1, :]
        slot.n_past = state.kv.length
        if not slot.todo:
            self._sample([slot], logits)

    def _decode(self, running: list[Slot]) -> None:
        lengths = [slot.state.kv.length for slot in running]
        longest = max(lengths)
        layers = []
        for index in range(len(running[0].state.kv.layers)):
            keys, values = [], []
            for slot, length in zip(running, lengths, strict=True):
                k, v = slot.state.kv.layers[index]
                pad = longest - length
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layers.append((torch.cat(keys), torch.cat(values)))
        mask = torch.zeros((len(running), longest + 1), dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, longest - length :] = 1
        ids = torch.tensor([[slot.next_token] for slot in running])
        positions = torch.tensor([[length] for length in lengths])
        logits, new_layers = self._forward(
            ids.to(self.device),
            layers,
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
        )
        for row, (slot, length) in enumerate(zip(running, lengths, strict=True)):
            cut = longest - length
            slot.state.kv.layers = [
                (k[row : row + 1, :, cut:], v[row : row + 1, :, cut:])
                for k, v in new_layers
            ]
            slot.n_past = length + 1
            slot.tokens.append(slot.next_token)
            slot.next_token = None
        self._sample(running, logits)

    def _sample(self, slots: list[Slot], logits: torch.Tensor) -> None:
        if self._masks is not None:
            self.finish_masks(self._masks)
            self._masks = None
        self.sample_each(
            [(slot, logits[row]) for row, slot in enumerate(slots)], self._sample_row
        )

    def _sample_row(self, slot: Slot, row: torch.Tensor) -> None:
        params = slot.request.params
        raw = row.float()  # a half-precision model's logits sampled in float32
        if not bool(torch.isfinite(raw).all()):
            raise ValueError("the model produced non-finite logits (NaN or inf)")
        entry_logprobs = None
        if params.logprobs:  # of the raw logits, before the grammar's mask
            entry_logprobs = raw.cpu().numpy()
        if slot.matcher is not None:
            allowed = torch.from_numpy(self.grammars.allowed(slot.index))
            raw = raw.masked_fill(~allowed.to(raw.device), -float("inf"))
        token = self._choose(slot, raw, params)
        entry = None
        if entry_logprobs is not None:
            entry = self.logprob_entry(entry_logprobs, token, params.top_logprobs)
        self.accept(slot, token, entry)

    def _choose(self, slot: Slot, logits: torch.Tensor, params: SamplingParams) -> int:
        """Penalties, then greedy or temperature / top-k / top-p / min-p sampling
        with the slot's own random generator."""
        state: _SlotState = slot.state
        if state.ids and (
            params.repeat_penalty != 1.0
            or params.frequency_penalty
            or params.presence_penalty
        ):
            logits = penalized(logits, state.ids, params)
        if params.temperature <= 0:
            return int(torch.argmax(logits))
        probs = sampling_probs(logits, params)
        generator = state.generator(probs.device)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))

    @property
    def placement_text(self) -> str:
        """The load's plan in one line (its reason and warnings)."""
        return self.placement.text

    def describe_placement(self) -> dict:
        """The plan, the dtype loaded, and where the modules landed (under a
        device map: its count of modules per device)."""
        described = self.placement.describe()
        if self.model is not None:
            described["loaded_dtype"] = str(self.model.dtype).removeprefix("torch.")
            landed = getattr(self.model, "hf_device_map", None) or {}
            counts: dict[str, int] = {}
            for where in landed.values():
                counts[str(where)] = counts.get(str(where), 0) + 1
            if counts:
                described["modules_per_device"] = counts
        return described

    def close(self) -> None:
        self.cancel_all()
        self.slots = []
        if self._grammars is not None:
            self._grammars.close()
        self.model = None
        self._kvs = []
        if self.placement.on_gpu and torch.cuda.is_initialized():
            # Hand the cards' memory back (torch caches what it freed): the
            # next load's plan and the residency's measures read it as free.
            gc.collect()
            torch.cuda.empty_cache()
