"""The typed request body of POST /v1/pulls (api.pulls): a source and what
to call the model, checked before the Hub is asked; unknown keys refused.
Its source's form (hf:ORG/REPO[:QUANTIZATION | /FILE]) is the pull's own
check (catalog.pull.pull_plan), which answers 400 with what to give."""

from typing import Annotated

from pydantic import Field

from .schema_base import NoNul, Strict

# The model names the catalog takes (catalog.models.MODEL_NAME_VALIDATOR), or
# none (the default).
MODEL_NAME_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9._:/-]*)?$"


class PullRequest(Strict):
    """POST /v1/pulls: pull a model into the catalog."""

    source: Annotated[
        str,
        Field(
            min_length=1,
            max_length=1000,
            description="hf:ORG/REPO[:QUANTIZATION | /FILE], e.g. "
            "hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M.",
        ),
        NoNul(),
    ]
    name: Annotated[
        str,
        Field(
            max_length=128,
            pattern=MODEL_NAME_PATTERN,
            description="The model's name in the catalog. Default: the "
            "repository's name and the file's quantization.",
        ),
    ] = ""
    revision: Annotated[
        str,
        Field(
            min_length=1,
            max_length=200,
            description="A branch, tag or commit; pinned to its commit at the start.",
        ),
        NoNul(),
    ] = "main"
    node: Annotated[
        str,
        Field(
            max_length=64,
            pattern=r"^[-a-zA-Z0-9_]*$",
            description="The node that pulls it (a cluster). Default: the "
            "node where the model's first replica is placed (would be, for a "
            "new one); on one host, its worker.",
        ),
    ] = ""
    sha256: Annotated[
        str,
        Field(
            pattern=r"^([0-9a-fA-F]{64})?$",
            description="The file's expected SHA-256, for a source that "
            "publishes none (the Hub publishes its own).",
        ),
    ] = ""
