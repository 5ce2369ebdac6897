"""Storage quotas of the Files API (batches.quotas): an owner's, everyone's,
checked when a file is stored; outputs count; deleting frees room."""

import pytest

from api import errors
from batches import services
from tests.factories import ApiKeyFactory

pytestmark = pytest.mark.django_db

KIB = 1024


@pytest.fixture
def quotas(settings, tmp_path):
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    settings.ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES = 10 * KIB
    settings.ROUNDHOUSE_FILES_QUOTA_TOTAL_BYTES = 25 * KIB
    settings.ROUNDHOUSE_FILES_MIN_FREE_BYTES = 0
    return settings


def store(key, size: int):
    line = b'{"pad": "' + b"x" * (size - 12) + b'"}\n'
    assert len(line) == size
    return services.file_store(key=key, chunks=[line], filename="f", purpose="batch")


def refusal(key, size: int) -> errors.ApiError:
    with pytest.raises(errors.ApiError) as refused:
        store(key, size)
    return refused.value


def test_an_owner_over_its_quota_is_refused_until_it_deletes(quotas):
    """Files that do not fit beside the owner's others: 429 quota_exceeded,
    saying how to make room; deleting a file frees it (control: the same
    upload is stored once a file is deleted); nothing of a refused upload
    is kept."""
    key = ApiKeyFactory()
    first = store(key, 6 * KIB)
    over = refusal(key, 6 * KIB)
    assert (over.status, over.code) == (429, "quota_exceeded")
    assert "Delete files" in over.message and "10240 bytes" in over.message
    assert sorted(p.name for p in quotas.ROUNDHOUSE_FILES_DIR.iterdir()) == [first.id]
    services.file_delete(stored=first)
    assert store(key, 6 * KIB).bytes == 6 * KIB


def test_a_file_larger_than_the_whole_quota_is_413(quotas):
    """A file that alone is larger than an owner's quota could never be
    stored: 413 quota_exceeded, not a 429 to retry."""
    over = refusal(ApiKeyFactory(), 11 * KIB)
    assert (over.status, over.code) == (413, "quota_exceeded")


def test_every_key_of_an_owner_shares_its_quota(quotas, django_user_model):
    """An owner's quota covers all its keys' files, as owner_filter sees
    them; another owner has its own."""
    user = django_user_model.objects.create(username="owner")
    store(ApiKeyFactory(owner=user), 6 * KIB)
    assert refusal(ApiKeyFactory(owner=user), 6 * KIB).code == "quota_exceeded"
    store(ApiKeyFactory(), 6 * KIB)


def test_all_stored_files_have_a_total(quotas):
    """Past the total, whoever uploads is refused with 429 storage_full."""
    for _ in range(4):
        store(ApiKeyFactory(), 6 * KIB)
    full = refusal(ApiKeyFactory(), 2 * KIB)
    assert (full.status, full.code) == (429, "storage_full")
    assert "storage is full" in full.message


def test_the_disk_keeps_its_free_space(quotas):
    """An upload that would leave less than ROUNDHOUSE_FILES_MIN_FREE_BYTES
    free on the files' disk is refused, whatever the quotas."""
    quotas.ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES = 2**62
    quotas.ROUNDHOUSE_FILES_QUOTA_TOTAL_BYTES = 2**62
    quotas.ROUNDHOUSE_FILES_MIN_FREE_BYTES = 2**61
    assert refusal(ApiKeyFactory(), 1 * KIB).code == "storage_full"


def test_a_batchs_output_counts_and_an_owner_at_its_quota_starts_none(quotas):
    """Output and error files count in their owner's quota; an owner with no
    room left cannot start a batch (its output would not fit)."""
    key = ApiKeyFactory()
    stored = store(key, 4 * KIB)
    batch = services.batch_create(
        key=key,
        input_file_id=stored.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )
    owner = "w:1:1:a"
    services.batch_claim(batch_id=batch.id, owner=owner)
    services.batch_start(batch=batch, total=1)
    services.batch_record(
        batch_id=batch.id,
        owner=owner,
        answers=[(0, "a", True, {"pad": "y" * 6 * KIB})],
    )
    services.batch_finalize(batch_id=batch.id, owner=owner, final="completed")
    assert refusal(key, 1 * KIB).code == "quota_exceeded"
    with pytest.raises(errors.ApiError) as refused:
        services.batch_create(
            key=key,
            input_file_id=stored.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=None,
        )
    assert refused.value.code == "quota_exceeded"
