"""The one-shot inspection programs the catalog runs as child processes, and
what they say to each other: `python -m engines.inspection.probe` (a model's
memory, loaded as an engine loads it), `python -m engines.inspection.quantize`
(a GGUF file in another quantization) and `python -m engines.inspection.evaluate`
(a GGUF model's speed and quality here). ("Tools" elsewhere means only the
tools a chat request offers a model.)

Each program reads one request, a JSON object, on stdin and writes one result, a
JSON object, on stdout; both sides validate them with the models below, which
refuse unknown keys. A model the program cannot handle (a missing file, one
llama.cpp will not load) is a result whose `problem` says so, not a crash. No
pickle, and nothing secret: a request carries paths, numbers and prompts.

No ML library is imported here: the web side imports this module."""

import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.launch.config import Limits
from engines.launch.environment import OFFLINE_ENV, inherited_environment

# The quantizations the catalog offers (llama.cpp's LLAMA_FTYPE_MOSTLY_<name>).
Quantization = Literal[
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K"
]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# The text perplexity is measured on (engines/inspection/data/README.md says
# where it is from).
EVALUATION_TEXT = Path(__file__).resolve().parent / "data" / "austen-chapter-1.txt"
# Prompts whose greedy continuations the original and its variant are compared
# on: prose, instructions, facts and code, as a chat model is asked for them.
EVALUATION_PROMPTS = (
    "The old lighthouse keeper climbed the stairs one last time and",
    "To make a good cup of tea, first",
    "The three largest planets in the solar system are",
    "def fibonacci(n):\n    ",
)
MIB = 2**20
# Set for every tool: weights come from the models directory, never a hub.
INSPECTION_ENV = dict(OFFLINE_ENV)


def inspection_environment(base: Mapping[str, str], *, root: str) -> dict[str, str]:
    """A tool's environment: what it uses of `base` (the engines' allow-list,
    engines/launch/environment.py: none of the web side's secrets), the
    project `root` on its path and INSPECTION_ENV."""
    env = inherited_environment(base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, base.get("PYTHONPATH")]))
    env.update(INSPECTION_ENV)
    return env


_DEFAULT_LIMITS = Limits()


class Message(BaseModel):
    """A request or result: unknown keys refused, values fixed once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ProbeRequest(Message):
    """Load this model as an engine with this backend and these limits would
    (its context and slot plan, engines/backends/memory.py) and measure it."""

    format: Literal["gguf", "transformers", "embedding"]
    path: str
    task: str = "chat"
    backend: Literal["cpu", "cuda", "rocm", "vulkan"] = "cpu"
    context_length: int | None = Field(default=None, ge=16)
    slots: int | None = Field(default=None, ge=1)
    kv_cache_mib: int = Field(default=_DEFAULT_LIMITS.kv_cache_mib, ge=1)
    max_slots_per_model: int = Field(default=_DEFAULT_LIMITS.max_slots_per_model, ge=1)
    threads: int = Field(default=0, ge=0)  # 0: one per usable core
    devices: list[str] = []  # the GPUs to read (UUIDs or indices); empty: all


class ProbeResult(Message):
    """What the load took: host memory (RSS growth), device memory where the
    model went to a GPU, the slot plan it was loaded with, the estimate the
    engines use until a measurement exists, and how long the load took."""

    host_mib: float = 0.0
    device_mib: float | None = None
    estimated_mib: float | None = None
    slots: int | None = None
    context: int | None = None
    kv_pool_tokens: int | None = None
    kv_mib: float | None = None
    load_s: float = 0.0
    problem: str = ""


class QuantizeRequest(Message):
    """Write `source` (a GGUF file) in another quantization to `target`."""

    source: str
    target: str
    quantization: Quantization
    threads: int = Field(default=0, ge=0)


class QuantizeResult(Message):
    quantization: str = ""
    file_mib: float = 0.0
    seconds: float = 0.0
    problem: str = ""


class EvaluateRequest(Message):
    """Measure a GGUF model here: prompt and generation speed, perplexity on
    the shipped text, and greedy continuations of fixed prompts; with a
    `reference` (another model's continuations, one list per prompt), how
    often this model's greedy choice agrees with them."""

    path: str
    text_path: str = str(EVALUATION_TEXT)
    # Tokens per perplexity window; the context is made large enough for the
    # prompts and their continuations too.
    window: int = Field(default=256, ge=16)
    prompt_tokens: int = Field(default=256, ge=1)
    prompts: list[Annotated[str, Field(min_length=1)]] = Field(
        default=list(EVALUATION_PROMPTS), min_length=1
    )
    max_tokens: int = Field(default=64, ge=1)
    repeats: int = Field(default=3, ge=1)
    threads: int = Field(default=0, ge=0)
    reference: list[list[int]] | None = None


class EvaluateResult(Message):
    """Speeds in tokens per second (median of the repeats for prompts); the
    perplexity over `perplexity_tokens` scored tokens; the greedy tokens per
    prompt; with a reference, `agreement` (the share of the reference's
    tokens this model also picks greedily, given the same text before them)
    and `identical_prefix` (the share of the reference's tokens its own
    greedy continuations repeat before they first differ)."""

    quantization: str = ""
    file_mib: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    perplexity: float = 0.0
    perplexity_tokens: int = 0
    greedy: list[list[int]] = []
    agreement: float | None = None
    identical_prefix: float | None = None
    threads: int = 0
    problem: str = ""


Request = TypeVar("Request", bound=Message)
Result = TypeVar("Result", bound=Message)


def inspection_main(
    request_type: type[Request], work: Callable[[Request], Result]
) -> int:
    """Read one request on stdin, do the work, write its result on stdout; the
    exit status (2: the request was refused)."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s"
    )
    # Only the result may reach the parent's stdout: native code (llama.cpp,
    # CUDA) may print there, so fd 1 becomes stderr for the tool's lifetime and
    # the result is written to a copy of the real stdout.
    sys.stdout.flush()
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        request = request_type.model_validate_json(sys.stdin.buffer.read())
    except ValidationError as error:
        print(f"refused request: {error}", file=sys.stderr)
        return 2
    result = work(request)
    with answer:
        answer.write(result.model_dump_json())
    return 0
