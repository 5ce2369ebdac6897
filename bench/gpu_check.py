"""The GPU path on a real card: a transformers model served by a real engine
process against transformers' own `generate`, same model, same card, same run.

Run: scripts/gpu_check.sh on an NVIDIA machine (it installs the carried wheels
and runs this with `--device cuda`); `.venv/bin/python bench/gpu_check.py
--device cpu --tiny` here proves the plumbing (engine start, load, streams,
table) on a few-MiB model.

The model is made from a config (a Llama with Llama-3.2-1B's shape, about 1B
parameters, random weights: speed does not depend on their values), saved in
bf16 with the tokenizer that `scripts/gpu_check.sh prepare` carries in
.gpu_check/tokenizer. The engine is started as the supervisor starts one
(spawn_engine: typed configuration, token in the environment, the spec's env
block with CUDA_VISIBLE_DEVICES, a lifeline pipe, backend `cuda`). Reported:
load time (engine `load` against `from_pretrained` + `.to(device)`), memory as
NVML sees it (card and engine process) against the engine's own figures
(`state`), and aggregate tokens/s and p50 time to first token at 1, 8 and 32
concurrent streams through AsyncEngineClient against one batched `generate` of
as many prompts (identical prompt token ids, greedy, EOS ignored), medians of
`--rounds` rounds, the two interleaved within each round. The anchor runs in
float32 like the engine does today; a `generate` in bf16 is shown beside it
(what issue 34's half precision would be measured against).
Goal (issue 34): >= 1.5x `generate` at 32 streams.
"""

import argparse
import asyncio
import datetime
import os
import platform as host_platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.launch.process import spawn_engine  # noqa: E402
from engines.wire.client import AsyncEngineClient, EngineClient, EngineError  # noqa: E402
from engines.wire.replies import DoneFrame, TokenFrame  # noqa: E402
from engines.wire.requests import GenerateRequest  # noqa: E402

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

TOKENIZER_DIR = ROOT / ".gpu_check" / "tokenizer"
MODEL_NAME = "gpu-check-1b"
MIB = 2**20
# Llama-3.2-1B's shape (tied embeddings, grouped-query attention) over the
# carried SmolLM2 tokenizer's 49152 tokens: about 1.07B parameters.
FULL_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
STARTED = time.monotonic()
# Request paths beside greedy decoding, each tried once after the measurements
# (a failure fails its own request only).
PROBES = [
    ("sampled (temperature 0.8, seed)", {"temperature": 0.8, "seed": 7}),
    (
        "penalties (repeat/presence/freq.)",
        {
            "temperature": 0,
            "repeat_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.2,
        },
    ),
    ("logprobs (top 3)", {"temperature": 0, "logprobs": True, "top_logprobs": 3}),
    (
        "JSON object (grammar)",
        {"temperature": 0, "response_format": {"type": "json_object"}},
    ),
]


def log(message: str) -> None:
    """A progress line with the wall-clock time and the seconds since start."""
    now = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
    print(f"[{now} +{time.monotonic() - STARTED:6.1f}s] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the model ------------------------------------------------------------------


def build_model(out: Path, *, shape: dict, device: str) -> int:
    """A random-weight Llama of `shape` saved in bf16 with the carried
    tokenizer; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR, local_files_only=True)
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it is fast
        model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return parameters


def prompts_for(
    tokenizer, count: int, round_index: int, length: int
) -> list[list[int]]:
    """`count` distinct prompts of `length` token ids (no two share a prefix
    beyond a few tokens, so no cache could serve one from another)."""
    prompts = []
    for index in range(count):
        text = (
            f"Story {round_index}-{index}: once upon a time in a small harbour "
            "town, a lighthouse keeper kept a logbook of every ship that passed, "
            "every storm, every fish the gulls stole from the quay, and more."
        )
        ids = tokenizer(text)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        prompts.append(ids[:length])
    return prompts


# -- NVML -----------------------------------------------------------------------


class Nvml:
    """Card and per-process memory through NVML (nvidia-ml-py); every reading
    is None where NVML is missing (here: no card)."""

    def __init__(self, index: int = 0) -> None:
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as error:  # noqa: BLE001 - no NVML: readings are None
            log(f"NVML not available: {error!r}")

    def describe(self) -> str:
        if self.handle is None:
            return "no NVML"
        name = self.nvml.nvmlDeviceGetName(self.handle)
        total = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total / MIB
        driver = self.nvml.nvmlSystemGetDriverVersion()
        return f"{name} ({total:.0f} MiB), driver {driver}"

    def card_used_mib(self) -> float | None:
        if self.handle is None:
            return None
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / MIB

    def process_used_mib(self, pid: int) -> float | None:
        if self.handle is None:
            return None
        try:
            running = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:  # noqa: BLE001 - not every driver lists processes
            return None
        for process in running:
            if process.pid == pid and process.usedGpuMemory is not None:
                return process.usedGpuMemory / MIB
        return None


# -- the engine -----------------------------------------------------------------


@dataclass
class StreamResult:
    ttft_s: float
    tokens: int
    engine_ttft_ms: float | None = None


class EngineUnderTest:
    """A real engine process started as the supervisor starts one."""

    def __init__(self, *, model_dir: Path, work: Path, args) -> None:
        self.port, self.token = free_port(), secrets.token_hex(32)
        self.log_path = work / "engine.log"
        cuda = args.device == "cuda"
        spec = {
            "name": MODEL_NAME,
            "format": "transformers",
            "task": "generation",
            "path": str(model_dir),
            "context_length": args.context,
            "slots": max(args.streams),
            # Every stream's prompt evaluated, as `generate` evaluates it.
            "prompt_cache": False,
            "keep_alive_s": 0,
        }
        config = {
            "name": "gpu-check",
            "port": self.port,
            "backend": "cuda" if cuda else "cpu",
            "models": [spec],
            "devices": ["0"] if cuda else [],
            "limits": {
                "max_parallel_requests": max(args.streams),
                "max_slots_per_model": max(args.streams),
                "queue_limit": 4 * max(args.streams),
                "threads": 0 if cuda else args.threads,
            },
        }
        # The spec's env block: the card, and where the carried wheels were
        # installed (the engine inherits no PYTHONPATH of its own).
        env = {"CUDA_VISIBLE_DEVICES": "0"} if cuda else {}
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        read_end, self.lifeline = os.pipe()
        started = time.perf_counter()
        try:
            self.process = spawn_engine(
                config=config,
                token=self.token,
                log_path=self.log_path,
                spec_env=env,
                config_dir=work / "engines",
                lifeline_fd=read_end,
            )
        finally:
            os.close(read_end)
        self.client = AsyncEngineClient(port=self.port, token=self.token)
        self._wait_ready(args.ready_timeout_s)
        self.start_s = time.perf_counter() - started

    def _wait_ready(self, timeout: float) -> None:
        client = EngineClient(port=self.port, token=self.token)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine exited ({self.process.returncode})")
            try:
                if client.ping().phase == "ready":
                    return
            except EngineError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the engine was not ready in {timeout:g} s")

    def load(self, timeout: float) -> tuple[float, dict]:
        started = time.perf_counter()
        reply = asyncio.run(self.client.load(MODEL_NAME, timeout=timeout))
        return time.perf_counter() - started, reply.model.model_dump()

    def state(self) -> dict:
        return asyncio.run(self.client.state()).model_dump()

    async def stream(self, prompt: list[int], tokens: int) -> StreamResult:
        request = GenerateRequest(
            model=MODEL_NAME,
            prompt_tokens=prompt,
            max_tokens=tokens,
            ignore_eos=True,
            temperature=0,
        )
        started = time.perf_counter()
        first, count, engine_ttft = None, 0, None
        async for frame in self.client.generate_stream(request):
            if isinstance(frame, TokenFrame) and frame.tokens and first is None:
                first = time.perf_counter() - started
            if isinstance(frame, DoneFrame):
                count = frame.usage.completion_tokens
                engine_ttft = frame.timings.first_token_ms
        return StreamResult(first or 0.0, count, engine_ttft)

    def probe(self, prompt: list[int], **fields) -> str:
        """One 16-token stream with these request fields: "ok" with what it
        made, or the error the engine answered."""

        async def one() -> str:
            request = GenerateRequest(
                model=MODEL_NAME, prompt_tokens=prompt, max_tokens=16, **fields
            )
            made, reason = 0, ""
            async for frame in self.client.generate_stream(request):
                if isinstance(frame, DoneFrame):
                    made, reason = frame.usage.completion_tokens, frame.finish_reason
            return f"ok ({made} tokens, {reason})"

        try:
            return asyncio.run(one())
        except Exception as error:  # noqa: BLE001 - the finding is the error
            return f"FAILED: {type(error).__name__}: {error}"[:400]

    def round(self, prompts: list[list[int]], tokens: int) -> dict:
        """All prompts as concurrent streams: aggregate tokens/s, p50 TTFT."""

        async def together():
            return await asyncio.gather(*(self.stream(p, tokens) for p in prompts))

        started = time.perf_counter()
        results = asyncio.run(together())
        elapsed = time.perf_counter() - started
        produced = sum(r.tokens for r in results)
        return {
            "tok_s": produced / elapsed,
            "ttft_ms": 1000 * statistics.median(r.ttft_s for r in results),
            "engine_ttft_ms": statistics.median(
                r.engine_ttft_ms or 0.0 for r in results
            ),
            "tokens": produced,
            "expected": tokens * len(prompts),
            "elapsed_s": elapsed,
        }

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no engine log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                asyncio.run(self.client.shutdown())
            except EngineError:
                self.process.terminate()
            try:
                self.process.wait(40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        os.close(self.lifeline)


# -- the anchor: transformers' own generate ------------------------------------------


class FirstToken:
    """A stopping criterion that never stops and notes when the first token
    came (generate calls it after each decoding step)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.at: float | None = None

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.at is None:
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.at = time.perf_counter()
        return torch.zeros(
            input_ids.shape[0], dtype=torch.bool, device=input_ids.device
        )


class GenerateAnchor:
    """The same model loaded in this process, as the engine loads it
    (`from_pretrained` in `dtype`, then `.to(device)`), driven by `generate`."""

    def __init__(self, model_dir: Path, *, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        started = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=getattr(torch, dtype)
        ).to(device)
        self.model.eval()
        self._sync()
        self.load_s = time.perf_counter() - started
        self.pad = self.model.config.pad_token_id or 0

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def round(self, prompts: list[list[int]], tokens: int) -> dict:
        """One batched `generate` of all prompts (left-padded): tokens/s, TTFT."""
        from transformers import StoppingCriteriaList

        torch = self.torch
        longest = max(len(p) for p in prompts)
        ids = [[self.pad] * (longest - len(p)) + p for p in prompts]
        mask = [[0] * (longest - len(p)) + [1] * len(p) for p in prompts]
        input_ids = torch.tensor(ids, device=self.device)
        attention = torch.tensor(mask, device=self.device)
        first = FirstToken(self.device)
        self._sync()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=self.pad,
                stopping_criteria=StoppingCriteriaList([first]),
            )
        self._sync()
        elapsed = time.perf_counter() - started
        produced = (out.shape[1] - longest) * len(prompts)
        return {
            "tok_s": produced / elapsed,
            "ttft_ms": 1000 * ((first.at or started) - started),
            "tokens": produced,
            "expected": tokens * len(prompts),
            "elapsed_s": elapsed,
        }

    def close(self) -> None:
        self.model = None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


# -- the run ------------------------------------------------------------------------


@dataclass
class Findings:
    header: list[str] = field(default_factory=list)
    load: dict = field(default_factory=dict)
    memory: list[tuple[str, float | None]] = field(default_factory=list)
    rounds: dict = field(default_factory=dict)  # (column, streams) -> [results]
    probes: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def median_of(findings: Findings, column: str, streams: int, key: str) -> float | None:
    rows = findings.rounds.get((column, streams))
    return statistics.median(r[key] for r in rows) if rows else None


def table(findings: Findings, streams: list[int]) -> str:
    lines = list(findings.header)
    load = findings.load
    lines.append("")
    lines.append("load                                   seconds")
    for label, key in (
        ("engine process start (to ready)", "engine_start_s"),
        ("engine `load` (imports torch on first use)", "engine_load_s"),
        ("from_pretrained float32 + .to, in-process", "generate_load_s"),
        ("from_pretrained bf16 + .to, in-process", "bf16_load_s"),
    ):
        if key in load:
            lines.append(f"  {label:<46} {load[key]:>8.1f}")
    if "engine_load_s" in load and "generate_load_s" in load:
        ratio = load["engine_load_s"] / load["generate_load_s"]
        lines.append(f"  {'engine load / in-process load':<46} {ratio:>7.2f}x")
    lines.append("")
    lines.append("memory (MiB)")
    for label, value in findings.memory:
        lines.append(f"  {label:<62} {mib(value):>9}")
    lines.append("")
    lines.append(
        "streams  engine tok/s  generate tok/s  ratio  generate-bf16 tok/s"
        "  TTFT p50 ms: engine (own)  generate  generate-bf16"
    )
    for count in streams:
        engine = median_of(findings, "engine", count, "tok_s")
        anchor = median_of(findings, "generate", count, "tok_s")
        bf16 = median_of(findings, "generate-bf16", count, "tok_s")
        ratio = f"{engine / anchor:.2f}x" if engine and anchor else "n/a"

        def show(value, width, digits=0):
            return (
                f"{value:>{width}.{digits}f}"
                if value is not None
                else "n/a".rjust(width)
            )

        engine_ttft = median_of(findings, "engine", count, "ttft_ms")
        own = median_of(findings, "engine", count, "engine_ttft_ms")
        own_text = f"({own:.0f})" if own is not None else "(n/a)"
        lines.append(
            f"{count:>7}  {show(engine, 12)}  {show(anchor, 14)}  {ratio:>5}  "
            f"{show(bf16, 19)}  {show(engine_ttft, 18)} {own_text:>7}  "
            f"{show(median_of(findings, 'generate', count, 'ttft_ms'), 8)}  "
            f"{show(median_of(findings, 'generate-bf16', count, 'ttft_ms'), 13)}"
        )
    top = max(streams)
    engine = median_of(findings, "engine", top, "tok_s")
    anchor = median_of(findings, "generate", top, "tok_s")
    if engine and anchor:
        verdict = "met" if engine / anchor >= 1.5 else "NOT met"
        lines.append(
            f"goal: >= 1.5x generate at {top} streams ... {verdict} "
            f"({engine / anchor:.2f}x)"
        )
    if findings.probes:
        lines.append("")
        lines.append("engine request paths other than greedy (16 tokens each):")
        lines += [f"  {name:<34} {outcome}" for name, outcome in findings.probes]
    lines += findings.notes
    return "\n".join(lines)


def write_table(args, findings: Findings) -> str:
    """The table so far, printed nowhere, written to --out (a run stopped at
    its time limit still leaves what it measured)."""
    text = table(findings, args.streams)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.txt").write_text(text + "\n", encoding="utf-8")
    return text


def versions() -> str:
    import torch
    import transformers

    cuda = torch.version.cuda or "none"
    return (
        f"python {host_platform.python_version()}, torch {torch.__version__} "
        f"(CUDA {cuda}), transformers {transformers.__version__}"
    )


def run(args, findings: Findings, work: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    nvml = Nvml() if cuda else None
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    card = nvml.describe() if nvml else f"CPU only ({os.cpu_count()} cores)"
    findings.header.append(f"gpu_check {when}: {card}; {versions()}")
    log(findings.header[-1])

    model_dir = work / "model"
    shape = TINY_SHAPE if args.tiny else FULL_SHAPE
    log(f"making the model ({'tiny' if args.tiny else '~1B'}) in {model_dir}")
    parameters = build_model(model_dir, shape=shape, device=args.device)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / MIB
    findings.header.append(
        f"model: Llama, {parameters / 1e6:,.0f}M parameters (hidden "
        f"{shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads), "
        f"random weights saved bf16 ({size:,.0f} MiB); the engine loads float32 "
        "(today's path)"
    )
    findings.header.append(
        f"{args.prompt_tokens} prompt tokens, {args.tokens} new tokens per stream, "
        f"greedy, EOS ignored, prompt cache off; medians of {args.rounds} rounds, "
        "engine and generate interleaved"
    )
    log(findings.header[-2])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    card_before = nvml.card_used_mib() if nvml else None
    log("starting the engine process")
    engine = EngineUnderTest(model_dir=model_dir, work=work, args=args)
    anchors: dict[str, GenerateAnchor] = {}
    try:
        findings.load["engine_start_s"] = engine.start_s
        log(f"engine ready in {engine.start_s:.1f} s (pid {engine.process.pid})")
        card_ready = nvml.card_used_mib() if nvml else None
        log("engine: loading the model")
        load_s, described = engine.load(args.load_timeout_s)
        findings.load["engine_load_s"] = load_s
        log(f"engine loaded the model in {load_s:.1f} s: {described}")
        if nvml:
            after = nvml.card_used_mib()
            findings.memory += [
                ("NVML card used before the engine started", card_before),
                ("NVML card used, engine ready (no model)", card_ready),
                ("NVML card used after the load", after),
                (
                    "NVML card growth over the load",
                    after - card_ready if None not in (after, card_ready) else None,
                ),
                (
                    "NVML engine process after the load",
                    nvml.process_used_mib(engine.process.pid),
                ),
            ]
        findings.memory += [
            (
                "engine: device_memory_mib (its nvidia-smi growth at load)",
                described.get("device_memory_mib"),
            ),
            (
                "engine: estimated_mib (weights + KV pool)",
                described.get("estimated_mib"),
            ),
            (
                "engine: memory_mib (host RSS growth at load)",
                described.get("memory_mib"),
            ),
            ("engine: kv_mib (its slot plan)", described.get("kv_mib")),
        ]
        log("generate anchor: loading the same model in this process (float32)")
        anchors["generate"] = GenerateAnchor(
            model_dir, device=args.device, dtype="float32"
        )
        findings.load["generate_load_s"] = anchors["generate"].load_s
        if not args.no_bf16:
            log("generate anchor: loading it again in bf16")
            anchors["generate-bf16"] = GenerateAnchor(
                model_dir, device=args.device, dtype="bfloat16"
            )
            findings.load["bf16_load_s"] = anchors["generate-bf16"].load_s
        # Each batch shape's first pass pays for kernel choices and allocator
        # growth: one discarded round of 16 tokens at every stream count.
        log(f"warming up: {args.streams} streams, 16 tokens each")
        for count in args.streams:
            warm = prompts_for(tokenizer, count, -1, args.prompt_tokens)
            engine.round(warm, 16)
            for anchor in anchors.values():
                anchor.round(warm, 16)
        deadline = STARTED + args.budget_s
        for round_index in range(args.rounds):
            for count in args.streams:
                if time.monotonic() > deadline:
                    findings.notes.append(
                        f"budget of {args.budget_s:g} s spent: round "
                        f"{round_index + 1} cut short at {count} streams"
                    )
                    log(findings.notes[-1])
                    break
                prompts = prompts_for(tokenizer, count, round_index, args.prompt_tokens)
                measured = {"engine": engine.round(prompts, args.tokens)}
                for column, anchor in anchors.items():
                    measured[column] = anchor.round(prompts, args.tokens)
                for column, result in measured.items():
                    findings.rounds.setdefault((column, count), []).append(result)
                    if result["tokens"] != result["expected"]:
                        findings.notes.append(
                            f"{column} at {count} streams made {result['tokens']} "
                            f"tokens, not {result['expected']}"
                        )
                write_table(args, findings)
                log(
                    f"round {round_index + 1}, {count} streams: "
                    + ", ".join(
                        f"{column} {r['tok_s']:.0f} tok/s ttft {r['ttft_ms']:.0f} ms "
                        f"({r['elapsed_s']:.1f} s)"
                        for column, r in measured.items()
                    )
                )
            else:
                continue
            break
        probe_prompt = prompts_for(tokenizer, 1, 99, args.prompt_tokens)[0]
        for name, fields in PROBES:
            findings.probes.append((name, engine.probe(probe_prompt, **fields)))
            log(f"probe {name}: {findings.probes[-1][1]}")
        state = engine.state()
        if nvml:
            findings.memory += [
                (
                    "NVML engine process after the streams",
                    nvml.process_used_mib(engine.process.pid),
                ),
                (
                    "NVML card used after the streams (engine + anchors)",
                    nvml.card_used_mib(),
                ),
            ]
        findings.memory.append(("engine: rss_mib after the streams", state["rss_mib"]))
        log(
            f"engine state: healthy {state['healthy']}, tokens "
            f"{state['tokens_generated']}, models {state['models']}"
        )
    except Exception:
        log("FAILED; the engine's log ends:\n" + engine.log_tail())
        raise
    finally:
        for anchor in anchors.values():
            anchor.close()
        engine.stop()
        log(f"engine stopped ({engine.process.returncode})")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "engine.log").write_bytes(engine.log_path.read_bytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a few-MiB model")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=None, help="new per stream")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2, help="CPU engine only")
    parser.add_argument("--no-bf16", action="store_true", help="no bf16 anchor")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="no new measurement round starts after this",
    )
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--load-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", help="folder for gpu_check.txt and engine.log")
    parser.add_argument("--work", help="folder for the model (default: a temp dir)")
    args = parser.parse_args()
    args.tokens = args.tokens or (16 if args.tiny else 128)
    args.rounds = args.rounds or (1 if args.tiny else 4)
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        print(f"{TOKENIZER_DIR} missing: run `scripts/gpu_check.sh prepare`")
        return 2
    # `timeout` sends SIGTERM: unwind (engine stopped, table written), not die.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    findings = Findings()
    findings.notes.append(
        "GGUF on CUDA: not measured (building llama-cpp-python for CUDA does not "
        "fit this run's time)"
    )
    failed = False
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        try:
            run(args, findings, Path(tmp))
        except BaseException:  # SystemExit from SIGTERM too: the table is written
            failed = True
            findings.notes.append("FAILED:\n" + traceback.format_exc())
            traceback.print_exc()
    print("\n" + write_table(args, findings), flush=True)
    log("done" + (" (FAILED)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
