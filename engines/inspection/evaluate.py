"""`python -m engines.inspection.evaluate`: how fast and how good a GGUF model
is on this
host (engines.inspection.messages EvaluateRequest on stdin, EvaluateResult on stdout).

One llama.cpp context on the CPU, one sequence, greedy choices only, so two
models measured with the same request are measured the same way:

- perplexity: the shipped text in windows of `window` tokens, each window
  evaluated at once, every token after a window's first scored;
- prompt speed: the text's first `prompt_tokens` tokens evaluated at once
  from an empty cache, the median of `repeats` runs (after the perplexity
  pass has touched every weight);
- generation speed and greedy continuations: each prompt, then up to
  `max_tokens` tokens one llama_decode at a time, each the most likely one;
- with a reference (another model's continuations): `agreement`, each prompt
  followed by the reference's tokens evaluated at once, counting the positions
  where this model's most likely token is the reference's next one. It judges
  every position on the same text, so one early difference does not decide
  the rest, as it does for `identical_prefix`."""

import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

from engines.backends.llama import init_llama_cpp
from engines.generation.prefix_sharing import common_prefix
from engines.inspection.messages import (
    MIB,
    EvaluateRequest,
    EvaluateResult,
    inspection_main,
)
from engines.inspection.quantize import gguf_quantization
from engines.launch.config import usable_cores


class EvaluationError(Exception):
    """The model cannot be evaluated; the message says why."""


class _Context:
    """A model and, once started, one llama.cpp context whose batch holds the
    whole context, so that every evaluation is one llama_decode."""

    def __init__(self, path: Path, *, threads: int) -> None:
        init_llama_cpp()
        self.threads = threads
        self.ctx = self.batch = None
        self.n_ctx = 0
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode("utf-8"), params
        )
        if not self.model:
            raise EvaluationError(f"llama.cpp cannot load {path.name}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        bos = llama_cpp.llama_vocab_bos(self.vocab)
        adds_bos = llama_cpp.llama_vocab_get_add_bos(self.vocab)
        self.bos = [bos] if adds_bos and bos >= 0 else []

    def start(self, n_ctx: int) -> None:
        """Create the context (tokenizing needs none)."""
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise EvaluationError(f"cannot create a {n_ctx}-token context")
        self.n_ctx = n_ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        """The text's tokens, without the BOS token."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(
            self.vocab, data, len(data), tokens, capacity, False, False
        )
        if count < 0:
            raise EvaluationError("the text cannot be tokenized")
        return list(tokens[:count])

    def decode(self, tokens: list[int], *, start: int = 0, outputs_from: int = -1):
        """Evaluate `tokens` at positions start.. after what the cache holds;
        logits for the last token, or for every token from `outputs_from` on
        (then returned, one row per token)."""
        if not tokens or start + len(tokens) > self.n_ctx:
            raise EvaluationError(
                f"{len(tokens)} tokens at {start} do not fit a {self.n_ctx} context"
            )
        last = len(tokens) - 1
        first = last if outputs_from < 0 else outputs_from
        batch = self.batch
        batch.n_tokens = len(tokens)
        for index, token in enumerate(tokens):
            batch.token[index] = token
            batch.pos[index] = start + index
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = 0
            batch.logits[index] = index >= first
        code = llama_cpp.llama_decode(self.ctx, batch)
        if code != 0:
            raise EvaluationError(f"llama_decode returned {code}")
        if outputs_from < 0:
            return None
        rows = llama_cpp.llama_get_logits(self.ctx)
        shape = (len(tokens) - first, self.n_vocab)
        return np.ctypeslib.as_array(rows, shape=shape).copy()

    def best_last(self) -> int:
        """The most likely next token after the last one evaluated."""
        row = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def is_end(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        if self.batch is not None:
            llama_cpp.llama_batch_free(self.batch)
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
        if self.model:
            llama_cpp.llama_model_free(self.model)


def _perplexity(context: _Context, text: list[int], window: int) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of the text's tokens, and how many
    tokens were scored."""
    step = window - len(context.bos)
    total, scored = 0.0, 0
    for begin in range(0, len(text), step):
        tokens = context.bos + text[begin : begin + step]
        if len(tokens) < 2:
            break
        context.clear()
        logits = context.decode(tokens, outputs_from=0)[:-1]
        targets = np.asarray(tokens[1:])
        peak = logits.max(axis=1, keepdims=True)
        shifted = (logits - peak).astype(np.float64)
        log_norm = np.log(np.exp(shifted).sum(axis=1))
        chosen = shifted[np.arange(len(targets)), targets]
        total += float((log_norm - chosen).sum())
        scored += len(targets)
    if not scored:
        raise EvaluationError("the text is too short to score")
    return float(np.exp(total / scored)), scored


def _prompt_speed(context: _Context, text: list[int], count: int, repeats: int):
    """Prompt tokens per second: `count` tokens of the text at once."""
    tokens = (context.bos + text * (1 + count // max(len(text), 1)))[:count]
    times = []
    for _ in range(repeats):
        context.clear()
        started = time.perf_counter()
        context.decode(tokens)
        times.append(time.perf_counter() - started)
    return len(tokens) / statistics.median(times)


def _generate(context: _Context, prompt: list[int], max_tokens: int):
    """The greedy continuation of a prompt, the one-token decodes it took, and
    their time."""
    context.clear()
    context.decode(prompt)
    produced, steps, spent = [], 0, 0.0
    token = context.best_last()
    while True:
        produced.append(token)
        position = len(prompt) + len(produced) - 1
        if (
            context.is_end(token)
            or len(produced) >= max_tokens
            or position + 1 >= context.n_ctx
        ):
            return produced, steps, spent
        started = time.perf_counter()
        context.decode([token], start=position)
        token = context.best_last()
        spent += time.perf_counter() - started
        steps += 1


def _agreement(context: _Context, prompt: list[int], reference: list[int]) -> int:
    """How many of the reference's tokens this model picks, given the prompt
    and the reference's tokens before each."""
    if not reference:
        return 0
    context.clear()
    tokens = prompt + reference[:-1]
    logits = context.decode(tokens, outputs_from=len(prompt) - 1)
    return int((logits.argmax(axis=1) == np.asarray(reference)).sum())


def evaluate(request: EvaluateRequest) -> EvaluateResult:
    """Measure the model, or say why it cannot be."""
    path, text_path = Path(request.path), Path(request.text_path)
    for needed in (path, text_path):
        if not needed.is_file():
            return EvaluateResult(problem=f"not found: {needed}")
    if request.reference is not None and len(request.reference) != len(request.prompts):
        return EvaluateResult(problem="the reference needs one list per prompt")
    threads = request.threads or usable_cores()
    context = None
    try:
        context = _Context(path, threads=threads)
        prompts = [context.bos + context.tokenize(text) for text in request.prompts]
        text = context.tokenize(text_path.read_text(encoding="utf-8"))
        longest = max(len(p) for p in prompts) + request.max_tokens
        if request.reference is not None:
            pairs = zip(prompts, request.reference, strict=True)
            longest = max(longest, *(len(p) + len(r) for p, r in pairs))
        context.start(max(request.window, request.prompt_tokens, longest))
        perplexity, scored = _perplexity(context, text, request.window)
        prompt_tps = _prompt_speed(
            context, text, request.prompt_tokens, request.repeats
        )
        greedy, steps, spent = [], 0, 0.0
        for prompt in prompts:
            produced, taken, seconds = _generate(context, prompt, request.max_tokens)
            greedy.append(produced)
            steps, spent = steps + taken, spent + seconds
        agreement = identical = None
        if request.reference is not None:
            total = sum(len(r) for r in request.reference) or 1
            agreed = sum(
                _agreement(context, p, r)
                for p, r in zip(prompts, request.reference, strict=True)
            )
            same = sum(
                common_prefix(own, r)
                for own, r in zip(greedy, request.reference, strict=True)
            )
            agreement, identical = agreed / total, same / total
    except EvaluationError as error:
        return EvaluateResult(problem=str(error))
    finally:
        if context is not None:
            context.close()
    return EvaluateResult(
        quantization=gguf_quantization(path),
        file_mib=round(path.stat().st_size / MIB, 1),
        prompt_tps=round(prompt_tps, 1),
        generation_tps=round(steps / spent, 1) if spent else 0.0,
        perplexity=round(perplexity, 3),
        perplexity_tokens=scored,
        greedy=greedy,
        agreement=None if agreement is None else round(agreement, 4),
        identical_prefix=None if identical is None else round(identical, 4),
        threads=threads,
    )


if __name__ == "__main__":
    sys.exit(inspection_main(EvaluateRequest, evaluate))
