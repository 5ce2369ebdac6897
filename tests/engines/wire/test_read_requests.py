"""The engine's reading of rerank, tokenize and detokenize requests
(engines/wire/requests.py): their caps and the shape of what they carry,
refused with bad_request naming what is wrong."""

import pytest

from engines.wire.bounds import MAX_TEXTS_PER_REQUEST
from engines.wire.errors import ProtocolError
from engines.wire.requests import (
    MAX_PROMPT_TOKENS,
    DetokenizeRequest,
    RerankRequest,
    TokenizeRequest,
    parse_request,
)

CHAT = [{"role": "user", "content": "hi"}]


def refusal(message: dict) -> str:
    with pytest.raises(ProtocolError) as refused:
        parse_request(message)
    assert refused.value.code == "bad_request"
    return refused.value.message


def test_well_formed_requests_are_read_as_their_kinds():
    """The control for the refusals below: each kind read into its model."""
    rerank = {"kind": "rerank", "model": "m", "query": "q", "documents": ["d"]}
    assert isinstance(parse_request(rerank), RerankRequest)
    chat = {"kind": "tokenize", "model": "m", "messages": CHAT}
    assert isinstance(parse_request(chat), TokenizeRequest)
    text = {"kind": "detokenize", "model": "m", "tokens": [1, 2]}
    assert isinstance(parse_request(text), DetokenizeRequest)


def test_rerank_documents_are_held_to_the_embedding_caps():
    """No documents, more than the cap, or a NUL character: refused."""
    base = {"kind": "rerank", "model": "m", "query": "q"}
    assert "documents is empty" in refusal({**base, "documents": []})
    many = ["d"] * (MAX_TEXTS_PER_REQUEST + 1)
    assert "exceed the cap" in refusal({**base, "documents": many})
    assert "NUL" in refusal({**base, "documents": ["a\x00b"]})


def test_tokenize_takes_one_prompt_and_checks_its_tools():
    """Both a prompt and messages, or neither, is refused; a tool choice
    naming no offered tool too."""
    base = {"kind": "tokenize", "model": "m"}
    assert "exactly one" in refusal({**base, "prompt": "x", "messages": CHAT})
    assert "exactly one" in refusal(base)
    named = {"messages": CHAT, "tool_choice": {"name": "f"}}
    assert "not among the tools" in refusal({**base, **named})


def test_detokenize_caps_its_token_ids():
    """More ids than a prompt may hold, or a negative id: refused."""
    base = {"kind": "detokenize", "model": "m"}
    assert "tokens" in refusal({**base, "tokens": [1] * (MAX_PROMPT_TOKENS + 1)})
    assert "tokens" in refusal({**base, "tokens": [-1]})
