"""POST /api/pull onto the catalog's pulls (api.pulls, catalog.pull_jobs):
Ollama's Hugging Face names (`hf.co/ORG/REPO[:QUANTIZATION]`) become the
pull's source (`hf:ORG/REPO[:QUANTIZATION]`), and the model is named in the
catalog as it was asked for, so that the tool that pulled it can then use it
by that name. Its progress is Ollama's status lines, one per change (the
pull's row read as api.pulls' event stream reads it), ending with `success`
or an error line. A caller that hangs up leaves the pull running (the
catalog's pull page, or DELETE /v1/pulls/{id}, cancels it). Only a key that
manages models may pull, as with /v1/pulls."""

import asyncio
import contextlib
import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from django import db
from django.http import HttpResponse, JsonResponse

from catalog.models import PullStatus

from ... import bodies, errors
from ...limits import Allowance
from ...pipeline import admission_hold
from ...pull_schemas import MODEL_NAME_PATTERN, PullRequest
from ...pulls import FINISHED, POLL_S, off_loop, pull_begin, pull_get
from ...sse import streaming_response
from . import protocol

# hf.co/ORG/REPO, optionally :QUANTIZATION (Ollama's :latest is no quantization).
HF_NAME = re.compile(
    r"^(?:https?://)?(?:hf\.co|huggingface\.co)/"
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.-]+))?$"
)
NDJSON = "application/x-ndjson"


def pull_source(name: str) -> tuple[str, str]:
    """The pull's source and the catalog name of an Ollama model name; 400
    for a name that is not a Hugging Face repository's."""
    found = HF_NAME.match(name)
    if found is None:
        raise errors.invalid_request(
            f"Cannot pull {name!r}: only Hugging Face models can be pulled here, "
            "named hf.co/ORG/REPO or hf.co/ORG/REPO:QUANTIZATION "
            "(e.g. hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M).",
            param="model",
        )
    tag = found["tag"]
    source = f"hf:{found['repo']}" + (f":{tag}" if tag and tag != "latest" else "")
    fits = len(name) <= 128 and re.match(MODEL_NAME_PATTERN, name)
    return source, name if fits else ""


def _digest(pull: bodies.ModelPull) -> str:
    return "sha256:" + hashlib.sha256(pull.source.encode()).hexdigest()


def _status(pull: bodies.ModelPull) -> dict[str, Any]:
    """The progress line of a pull under way."""
    digest = _digest(pull)
    if pull.status == PullStatus.QUEUED or not pull.size_bytes:
        return {"status": "pulling manifest"}
    return protocol.Progress(
        status=f"downloading {digest}",
        digest=digest,
        total=pull.size_bytes,
        completed=pull.done_bytes,
    ).model_dump(mode="json")


def _ended(pull: bodies.ModelPull) -> list[dict[str, Any]]:
    """The last lines of a pull that has ended."""
    if pull.status == PullStatus.DONE:
        return [
            {"status": "verifying sha256 digest"},
            {"status": "writing manifest"},
            {"status": "success"},
        ]
    why = pull.message or pull.status
    return [{"error": f"pull {pull.status}: {why}"}]


async def _changes(first: bodies.ModelPull) -> AsyncIterator[bodies.ModelPull]:
    """The pull now, then each time it changes, until it has ended."""
    last = first
    yield first
    while last.status not in FINISHED:
        await asyncio.sleep(POLL_S)
        now = await pull_get(pull_id=first.id)
        if now is None:  # its row was deleted (in the admin)
            raise errors.pull_not_found(str(first.id))
        if now != last:
            last = now
            yield now


async def pull_lines(first: bodies.ModelPull) -> AsyncIterator[dict[str, Any]]:
    """Ollama's progress lines of the pull: a database or row failure ends
    them with an error line."""
    said: dict[str, Any] = {"status": "pulling manifest"}
    yield said
    try:
        async for pull in _changes(first):
            if pull.status in FINISHED:
                for line in _ended(pull):
                    yield line
                return
            line = _status(pull)
            if line != said:
                said = line
                yield line
    except db.Error:
        yield {"error": "The database is unavailable; the pull goes on."}
    except errors.ApiError as error:
        yield {"error": error.message}


def _encoded(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


async def pull_answer(key, body: protocol.PullBody) -> HttpResponse:
    """Start the pull; its progress streamed (Ollama's default), or its last
    line once it has ended."""
    if not key.manages_models:
        raise errors.models_not_managed()
    source, name = pull_source(body.named)
    payload = PullRequest(source=source, name=name)
    async with contextlib.AsyncExitStack() as held:  # starting it: admitted
        await admission_hold(held, Allowance.of_key(key))
        started = await off_loop(pull_begin)(key=key, payload=payload)
    if not body.stream:
        last: dict[str, Any] = {}
        async for line in pull_lines(started):
            last = line
        status = 500 if "error" in last else 200
        return JsonResponse(last, status=status)

    async def content() -> AsyncIterator[bytes]:
        async for line in pull_lines(started):
            yield _encoded(line)

    return streaming_response(content(), None, content_type=NDJSON)
