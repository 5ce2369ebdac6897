"""The catalog's SHA-256 of each model's files (ModelConfig.file_digests):
recorded by the model's first inspection, or the first hash of a host that
may write them, and never replaced by a later one; copies between nodes are
checked against them (tests/platform/node_link/test_files.py)."""

import os

import pytest
from node_link.files import file_sha256

from catalog.models import ModelConfig
from catalog.services import model_file_digests_record, model_inspection_run
from tests.factories import ModelConfigFactory

pytestmark = pytest.mark.django_db


def test_the_first_inspection_records_the_files_digests(tmp_path):
    """(control: a model without files records none)"""
    path = tmp_path / "m.gguf"
    path.write_bytes(os.urandom(5000))
    model = ModelConfigFactory(path=str(path))
    gone = ModelConfigFactory(path=str(tmp_path / "gone.gguf"))
    model_inspection_run(model_id=model.pk)
    model_inspection_run(model_id=gone.pk)
    assert ModelConfig.objects.get(pk=model.pk).file_digests == {"": file_sha256(path)}
    assert ModelConfig.objects.get(pk=gone.pk).file_digests == {}


def test_the_first_digests_recorded_stay(tmp_path):
    """A later hash (of files changed, or planted, since) never replaces the
    catalog's (control: the first is kept)."""
    model = ModelConfigFactory(path="m.gguf")
    assert model_file_digests_record(name=model.name, digests={"": "a" * 64})
    assert not model_file_digests_record(name=model.name, digests={"": "b" * 64})
    assert ModelConfig.objects.get(pk=model.pk).file_digests == {"": "a" * 64}
