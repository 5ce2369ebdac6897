"""Helpers for tests of the Batch API: input files and waiting for a batch."""

import json

import openai

from tests.waiting import wait_for

ENDED = {"completed", "failed", "cancelled", "expired"}


def jsonl(lines: list) -> bytes:
    """A batch input file: dicts as JSON lines, bytes as they are."""
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
        for line in lines
    )


def chat_line(custom_id: str, text: str, *, model: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 8,
            "temperature": 0,
            **body,
        },
    }


def wait_batch(client: openai.OpenAI, batch_id: str, until=ENDED, timeout=300):
    """The batch once its status is in `until` (or the predicate holds)."""
    seen = []

    def ended():
        batch = client.batches.retrieve(batch_id)
        seen.append(batch)
        done = until(batch) if callable(until) else batch.status in until
        return batch if done else None

    try:
        return wait_for(ended, timeout=timeout, interval=0.2, what="the batch")
    except AssertionError:
        raise AssertionError(f"batch stuck: {seen[-1]}") from None


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    """The lines of an output or error file."""
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines()]
