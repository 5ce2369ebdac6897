"""Real engine processes on loopback for the engine tests."""

import secrets
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings

from engines.launch.process import spawn_engine
from engines.wire.client import AsyncEngineClient, EngineClient, EngineError
from tests.waiting import wait_for

EMBEDDER = "all-minilm-l6-v2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def embedder_spec(**overrides) -> dict:
    return {
        "name": EMBEDDER,
        "format": "embedding",
        "task": "embedding",
        "path": str(Path(settings.MODELS_DIR) / "all-MiniLM-L6-v2"),
        "batch_window_ms": 5.0,
        "max_batch_size": 64,
        **overrides,
    }


@dataclass
class EngineProcess:
    """An engine started the way the supervisor starts one."""

    process: subprocess.Popen
    port: int
    token: str
    log_path: Path

    def client(self) -> EngineClient:
        return EngineClient(port=self.port, token=self.token)

    def aclient(self) -> AsyncEngineClient:
        return AsyncEngineClient(port=self.port, token=self.token)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.client().call("shutdown")
            except EngineError:
                self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_engine(
    log_dir: Path,
    *,
    models: list[dict],
    preload=(),
    wait_ready: bool = True,
    devices=(),
    limits: dict | None = None,
    backend: str = "cpu",
    cpus=(),
) -> EngineProcess:
    port, token = free_port(), secrets.token_hex(32)
    config = {
        "name": "test",
        "port": port,
        "backend": backend,
        "models": models,
        "preload": list(preload),
        "devices": list(devices),
        "cpus": list(cpus),
        "limits": limits or {},
    }
    log_path = log_dir / f"engine-{port}.log"
    process = spawn_engine(config=config, token=token, log_path=log_path)
    engine = EngineProcess(process, port, token, log_path)
    if not wait_ready:
        return engine
    outcome = started(process, engine.client(), timeout=120)
    if outcome != "ready":
        engine.stop()
        pytest.fail(f"engine did not start ({outcome}):\n{engine.log()}")
    return engine


def started(process: subprocess.Popen, client: EngineClient, *, timeout: float) -> str:
    """Wait for a starting engine: "ready", "exited" or "timed out"."""

    def settled() -> str:
        if process.poll() is not None:
            return "exited"
        try:
            return "ready" if client.ping().phase == "ready" else ""
        except EngineError:
            return ""

    try:
        return wait_for(settled, timeout=timeout, interval=0.2, what="the engine")
    except AssertionError:
        return "timed out"


@pytest.fixture(scope="module")
def embed_engine(tmp_path_factory):
    """One engine with the bundled MiniLM embedder resident, for a test module."""
    engine = start_engine(
        tmp_path_factory.mktemp("engine"), models=[embedder_spec()], preload=[EMBEDDER]
    )
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def reference_embedder():
    """The same model encoded in-process: what the engine must return."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(
        str(Path(settings.MODELS_DIR) / "all-MiniLM-L6-v2"), device="cpu"
    )


def build_tiny_llama(out: Path) -> Path:
    """A real (random-weight) Llama with a BPE tokenizer trained on a few lines
    and a chat template: the whole transformers code path in well under a second."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    lines = [
        "the cat sat on the mat",
        "a dog ran in the park",
        "hello world, how are you?",
        "ships sail on the sea",
    ] * 20
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engine_limits():
    """Change an engine's limits for one test: `engine_limits(engine, **changes)`
    pushes its current limits with `changes` applied (`configure`) and returns
    them. Each engine changed gets the limits it had before back at teardown,
    whether the test passed or not (an engine stopped by then needs none)."""
    before: dict[int, tuple[EngineProcess, dict]] = {}

    def change(engine: EngineProcess, **changes) -> dict:
        current = engine.client().state().limits
        before.setdefault(engine.port, (engine, current))
        limits = {**current, **changes}
        engine.client().call("configure", config={"limits": limits})
        return limits

    yield change
    for engine, limits in before.values():
        if engine.process.poll() is None:
            engine.client().call("configure", config={"limits": limits})
