"""Storing what a load measured (host RAM and GPU memory) on the model;
requantized variants' files: each its own, never another model's, and
removed only when no model points at them."""

import re

import pytest

from catalog.models import ModelConfig
from catalog.requantize import variant_path
from catalog.selectors import models_servable_by
from catalog.services import (
    model_memory_record,
    model_requantize_queue,
    model_variant_files_remove,
)
from tests.factories import ModelConfigFactory

pytestmark = pytest.mark.django_db


def test_host_and_device_memory_are_stored_and_reach_the_engines():
    model = ModelConfigFactory(name="m", format="gguf")
    assert model_memory_record(name="m", memory_mib=120.4, device_memory_mib=950.6)
    model.refresh_from_db()
    assert (model.measured_memory_mib, model.measured_device_memory_mib) == (120, 951)
    specs = models_servable_by(capabilities=frozenset({"gguf"}))
    [spec] = [spec for spec in specs if spec["name"] == "m"]
    assert (spec["measured_mib"], spec["measured_device_mib"]) == (120, 951)


def test_small_changes_are_not_written_and_zero_means_unmeasured():
    ModelConfigFactory(name="m")
    model_memory_record(name="m", memory_mib=100, device_memory_mib=1000)
    assert not model_memory_record(name="m", memory_mib=105, device_memory_mib=0)
    assert model_memory_record(name="m", memory_mib=105, device_memory_mib=1500)
    model = ModelConfig.objects.get(name="m")
    assert (model.measured_memory_mib, model.measured_device_memory_mib) == (100, 1500)
    assert not model_memory_record(name="unknown", memory_mib=1)


def test_a_variant_file_another_model_uses_stays_however_its_path_is_spelt(
    settings, tmp_path
):
    """Deleting a variant keeps its file while another model points at that
    file by another spelling (absolute, `./`, a doubled slash, through a
    link); a variant file nobody else uses goes (the control)."""
    settings.MODELS_DIR = tmp_path
    folder = tmp_path / "requantized"
    folder.mkdir()
    (tmp_path / "link").symlink_to(folder)
    original = ModelConfigFactory(name="orig", path="orig.gguf")
    spellings = [
        str(folder / "v-q4_0.gguf"),
        "./requantized/v-q5_0.gguf",
        "requantized//v-q6_k.gguf",
        "link/v-q8_0.gguf",
    ]
    variants = []
    for spelling in [*spellings, "requantized/v-q2_k.gguf"]:
        name = spelling.rsplit("/", 1)[1].removesuffix(".gguf")
        (folder / f"{name}.gguf").write_bytes(b"GGUF")
        variants.append(
            ModelConfigFactory(
                name=name,
                path=f"requantized/{name}.gguf",
                derived_from=original,
                quantized_to=name.split("-")[1].upper(),
            )
        )
    for n, spelling in enumerate(spellings):
        ModelConfigFactory(name=f"same-file-{n}", path=spelling)
    for variant in variants:
        variant.delete()
    removed = model_variant_files_remove(models=variants)
    assert removed == [(folder / "v-q2_k.gguf").resolve()]
    assert sorted(p.name for p in folder.iterdir()) == [
        "v-q4_0.gguf",
        "v-q5_0.gguf",
        "v-q6_k.gguf",
        "v-q8_0.gguf",
    ]


def test_variant_names_give_distinct_files():
    """Names that a file name would make alike (`a/b` and `a_b`, `a:b`, `A`
    and `a`) each get their own variant file; a plain lowercase name keeps
    its name (the control)."""
    names = ["a/b-q4_0", "a_b-q4_0", "a:b-q4_0", "A_b-q4_0"]
    paths = [variant_path(name) for name in names]
    assert len(set(paths)) == len(names)
    assert len({path.lower() for path in paths}) == len(names)
    assert variant_path("a_b-q4_0") == "requantized/a_b-q4_0.gguf"
    assert all(re.fullmatch(r"requantized/[A-Za-z0-9._-]+\.gguf", p) for p in paths)


def test_a_variant_is_never_written_over_another_models_file(
    settings, tmp_path, django_capture_on_commit_callbacks
):
    """A model already at the file a new variant would get (here the plain
    name's, spelt `./`) makes the request fail, saying whose file it is;
    nothing is queued or registered. The control: once that model points
    elsewhere, the variant is made."""
    settings.MODELS_DIR = tmp_path
    smol = ModelConfigFactory(name="smol")
    squatter = ModelConfigFactory(name="other", path="./requantized/smol-q8_0.gguf")
    with django_capture_on_commit_callbacks() as sent:
        with pytest.raises(ValueError, match="which is other's file"):
            model_requantize_queue(model=smol, quantization="Q8_0")
    assert sent == [] and not smol.variants.exists()
    squatter.path = "elsewhere.gguf"
    squatter.save()
    with django_capture_on_commit_callbacks() as sent:
        variant = model_requantize_queue(model=smol, quantization="Q8_0")
    assert variant.path == "requantized/smol-q8_0.gguf" and len(sent) == 1
