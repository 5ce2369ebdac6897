"""Memory estimates from model files, before any load."""

import io
from pathlib import Path

import pytest
from django.conf import settings

from engines.backends.memory import estimate_model_mib, plan_slots
from engines.launch.config import Limits, ModelSpec


def spec(fmt: str, path: str, context: int | None = 512) -> ModelSpec:
    return ModelSpec(
        name="m",
        format=fmt,
        path=str(Path(settings.MODELS_DIR) / path),
        context_length=context,
    )


def test_gguf_estimate_is_file_size_plus_kv_per_slot_plus_compute():
    """SmolLM2: 30 layers, 3 KV heads x 64 dims, f16 K and V, per context
    token; llama.cpp's compute buffer for a 512-token step is its 49,152
    logits plus 576 activations a token in float32 (99.4 MiB measured by
    llama.cpp at 4,096 tokens), while the attention scores over up to 4,096
    tokens of KV (10 x 4,096 a token) are smaller."""
    model = spec("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    file_mib = Path(model.path).stat().st_size / 2**20
    kv_per_token_mib = 2 * 30 * 192 * 2 / 2**20
    compute_mib = 4 * 512 * (576 + 49_152) / 2**20
    one = estimate_model_mib(model, slots=1)
    eight = estimate_model_mib(model, slots=8)
    assert one == pytest.approx(file_mib + 512 * kv_per_token_mib + compute_mib)
    assert eight - one == pytest.approx(7 * 512 * kv_per_token_mib)
    # Past ~4,800 tokens of KV the attention scores outgrow the logits.
    sixty_four = estimate_model_mib(model, slots=64)
    attention_mib = 4 * 512 * (1 + 4 * 576 + 64 * 512 * 10) / 2**20
    assert sixty_four == pytest.approx(
        file_mib + 64 * 512 * kv_per_token_mib + attention_mib
    )


def test_transformers_from_gguf_counts_float32_weights():
    """A GGUF loaded by transformers is dequantized: 4 bytes per parameter."""
    estimate = estimate_model_mib(
        spec("transformers", "SmolLM2-135M-Instruct.Q4_1.gguf", 256), slots=1
    )
    assert 134_515_008 * 4 / 2**20 < estimate < 134_515_008 * 4 / 2**20 + 50


def test_embedder_estimate_is_its_weights():
    estimate = estimate_model_mib(spec("embedding", "all-MiniLM-L6-v2", None), slots=1)
    assert 80 < estimate < 95


def test_header_reader_agrees_with_the_gguf_package():
    """The fast header reader gives the keys and parameter count that the gguf
    package's full reader gives (the reference), and remembers the file."""
    from gguf import GGUFReader

    from engines.backends.ggufmeta import read_header

    path = Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reference = GGUFReader(str(path))
    header = read_header(path)
    arch = header.get("general.architecture")
    assert arch == str(
        bytes(reference.fields["general.architecture"].parts[-1]), "utf-8"
    )
    for key in ("block_count", "embedding_length", "attention.head_count_kv"):
        field = reference.fields[f"{arch}.{key}"]
        assert header.get(f"{arch}.{key}") == int(field.parts[field.data[0]][0])
    assert header.parameters == sum(int(t.n_elements) for t in reference.tensors)
    assert read_header(path) is header


def test_header_reader_refuses_what_is_not_gguf(tmp_path):
    """A truncated header or another file is a clear error, never a wrong guess."""
    from engines.backends.ggufmeta import GGUFFormatError, read_header

    whole = (Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:4096])
    with pytest.raises(GGUFFormatError):
        read_header(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFFormatError):
        read_header(other)


def test_auto_slots_follow_the_kv_budget_up_to_the_cap():
    """SmolLM2 (22.5 KiB of KV per token): auto slots are one per 1,024 tokens
    of the budget, at most the cap; the pool is the budget, at most every
    slot's whole context, at least one context. Set slots are kept."""
    per_token = 2 * 30 * 192 * 2 / 2**20
    model = spec("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", 2048)
    roomy = plan_slots(model, Limits(kv_cache_mib=1024, max_slots_per_model=8))
    assert (roomy.slots, roomy.context, roomy.pool_tokens) == (8, 2048, 8 * 2048)
    assert roomy.auto and roomy.kv_mib == pytest.approx(8 * 2048 * per_token)
    tight = plan_slots(model, Limits(kv_cache_mib=90, max_slots_per_model=8))
    budget = int(90 / per_token)  # 4,096 tokens
    assert (tight.slots, tight.pool_tokens) == (budget // 1024, budget)
    tiny = plan_slots(model, Limits(kv_cache_mib=16, max_slots_per_model=8))
    assert (tiny.slots, tiny.pool_tokens) == (1, 2048)  # one whole context
    model.slots = 3
    fixed = plan_slots(model, Limits(kv_cache_mib=1024, max_slots_per_model=8))
    assert (fixed.slots, fixed.pool_tokens, fixed.auto) == (3, 3 * 2048, False)
    # Its estimate counts the pool, and the attention scores over it.
    estimate = estimate_model_mib(model, pool_tokens=fixed.pool_tokens)
    assert estimate == pytest.approx(
        Path(model.path).stat().st_size / 2**20
        + 3 * 2048 * per_token
        + 4 * 512 * (1 + 4 * 576 + 3 * 2048 * 10) / 2**20
    )


def test_a_gguf_models_slots_split_into_kv_groups_of_at_least_two_contexts():
    """KV groups (one llama.cpp context each): as many as leave each group 4
    slots and two whole contexts of the pool, at most 4; but a pool that
    holds every slot's whole context gets a KV stream per slot in one
    context instead; transformers keeps one group (its slots hold their own
    tensors)."""
    model = spec("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", 2048)
    # The default 1.5 GiB holds 32 whole contexts: a KV stream per slot.
    default = plan_slots(model, Limits())
    assert (default.slots, default.pool_tokens) == (32, 32 * 2048)
    assert (default.kv_groups, default.kv_streams) == (1, True)
    grouped = plan_slots(model, Limits(kv_cache_mib=1024))  # 46,603 tokens
    assert (grouped.slots, grouped.kv_groups) == (32, 4)
    assert grouped.describe()["kv_groups"] == 4
    assert not grouped.kv_streams  # under 32 whole contexts
    roomy = plan_slots(model, Limits(kv_cache_mib=1024, max_slots_per_model=8))
    assert (roomy.kv_groups, roomy.kv_streams) == (1, True)  # 8 whole contexts
    assert roomy.describe()["kv_streams"]
    just = plan_slots(model, Limits(kv_cache_mib=1440, max_slots_per_model=32))
    assert (just.pool_tokens, just.kv_groups, just.kv_streams) == (32 * 2048, 1, True)
    under = plan_slots(model, Limits(kv_cache_mib=1439, max_slots_per_model=32))
    assert (under.kv_groups, under.kv_streams) == (4, False)  # the control
    tight = plan_slots(model, Limits(kv_cache_mib=180, max_slots_per_model=32))
    assert (tight.slots, tight.pool_tokens // 4096) == (8, 2)
    assert (tight.kv_groups, tight.kv_streams) == (2, False)  # two of two contexts
    small = plan_slots(model, Limits(kv_cache_mib=90, max_slots_per_model=32))
    assert small.kv_groups == 1  # 4,096 tokens hold two contexts: one group
    hf = spec("transformers", "SmolLM2-135M-Instruct.Q4_1.gguf", 2048)
    assert plan_slots(hf, Limits()).kv_groups == 1
    hf_roomy = plan_slots(hf, Limits(kv_cache_mib=1024, max_slots_per_model=8))
    assert not hf_roomy.kv_streams


def test_the_default_context_is_the_trained_one_up_to_4096():
    model = spec("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", None)
    plan = plan_slots(model, Limits())
    assert plan.context == 4096  # SmolLM2 was trained on 8,192


class CountingFile(io.FileIO):
    """A file that counts the bytes read from it (what a ranged file object
    over HTTP would fetch)."""

    read_bytes = 0

    def read(self, size=-1):
        data = super().read(size)
        self.read_bytes += len(data)
        return data


def test_a_header_is_read_from_a_file_object_without_reading_the_weights(tmp_path):
    """Through a seekable file object (as a ranged one over HTTP), the header
    reads the same as through the memory map, from the first blocks only;
    a file that is not GGUF is refused from its first block. Control: the
    whole file is far larger than what was read."""
    from engines.backends.ggufmeta import GGUFFormatError, read_header, read_header_from

    path = Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    size = path.stat().st_size
    with CountingFile(path) as handle:
        header = read_header_from(handle, size, name=path.name)
    assert header == read_header(path)
    assert header.get("tokenizer.chat_template")
    assert handle.read_bytes <= 4 * (1 << 20) < size // 10
    other = tmp_path / "weights.safetensors"
    other.write_bytes(b"PK\x03\x04" + bytes(3 << 20))
    with CountingFile(other) as handle, pytest.raises(GGUFFormatError):
        read_header_from(handle, other.stat().st_size, name=other.name)
    assert handle.read_bytes == 1 << 20


def test_the_fit_before_a_download_is_the_estimate_residency_uses():
    """From a header read through a file object (as before a download), a
    GGUF model's estimate equals the one residency makes of the file on disk,
    at each context and slot count; control: another context differs."""
    from engines.backends.ggufmeta import read_header_from
    from engines.backends.memory import gguf_estimate_mib

    model = spec("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    size = Path(model.path).stat().st_size
    with open(model.path, "rb") as handle:
        header = read_header_from(handle, size)
    for slots in (1, 4):
        assert gguf_estimate_mib(
            header, size, context=512, slots=slots
        ) == estimate_model_mib(model, slots=slots)
    assert gguf_estimate_mib(header, size, context=2048) != estimate_model_mib(model)
