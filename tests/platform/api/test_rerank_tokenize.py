"""Tokenize, detokenize and rerank end to end against a live front (uvicorn,
`manage.py supervise`, a real engine serving the bundled SmolLM2 and MiniLM,
and a tiny random cross-encoder this module builds and saves as a catalog
model of the rerank task). Started once for the module."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from catalog.models import ModelConfig
from engines.wire.requests import MAX_PROMPT_TOKENS
from tests.platform import live_platform
from tests.platform.live_platform import (
    CHAT,
    EMBEDDER,
    ENGINE,
    start_live,
    wait_for_usage,
)

database = live_platform.database
models_dir_path = live_platform.models_dir_path
orm = live_platform.orm

RERANKER = "tiny-cross-encoder"
# Long enough that concurrent callers' pairs meet in one batch.
RERANK_WINDOW_MS = 400
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def build_cross_encoder(out: Path, models_dir: Path) -> Path:
    """A real (random-weight) BERT cross-encoder: one relevance label, the
    bundled MiniLM's tokenizer, saved as sentence-transformers' CrossEncoder
    saves one."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(models_dir / "all-MiniLM-L6-v2"))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=1,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    CrossEncoder(str(out), device="cpu").save(str(out))
    return out


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory, models_dir_path) -> Path:
    return build_cross_encoder(
        tmp_path_factory.mktemp("cross-encoder"), models_dir_path
    )


@pytest.fixture(scope="module")
def live(database, django_db_blocker, tmp_path_factory, models_dir_path, reranker_path):
    def reranker():
        ModelConfig.objects.create(
            name=RERANKER,
            format="embedding",
            task="rerank",
            path=str(reranker_path),
            batch_window_ms=RERANK_WINDOW_MS,
        )

    tmp = tmp_path_factory.mktemp("live-rerank")
    with start_live(
        django_db_blocker, tmp, models_dir_path, more_rows=reranker
    ) as platform:
        yield platform


def post(live, path: str, body: dict, key: str = "main"):
    status, headers, answer = live.post(path, json.dumps(body).encode(), key=key)
    return status, headers, answer


# -- tokenize, detokenize ----------------------------------------------------------


def test_a_chats_token_count_is_the_prompt_tokens_its_completion_reports(live, orm):
    """/tokenize counts a chat as /v1/chat/completions evaluates it: the
    count equals that completion's usage.prompt_tokens, with tools offered
    too, and tools change the count (the control: a count that ignored them
    would pass the first check alone)."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Oslo today?"},
    ]
    counts = {}
    for name, extra in (("plain", {}), ("tools", {"tools": [WEATHER_TOOL]})):
        completion = live.client().chat.completions.create(
            model=CHAT, messages=messages, max_tokens=2, temperature=0, **extra
        )
        status, headers, answer = post(
            live, "/tokenize", {"model": CHAT, "messages": messages, **extra}
        )
        assert status == 200, answer
        assert answer["count"] == completion.usage.prompt_tokens
        assert answer["count"] == len(answer["tokens"])
        assert answer["max_model_len"] == 1024  # the catalog's context
        assert headers["X-Roundhouse-Engine"] == ENGINE
        counts[name] = answer["count"]
    assert counts["tools"] > counts["plain"]
    row = wait_for_usage(endpoint="tokenize", status=200)
    assert (row.model, row.engine, row.prompt_tokens) == (CHAT, ENGINE, 0)


def test_without_the_generation_prompt_a_chat_has_fewer_tokens(live):
    """add_generation_prompt false leaves the assistant turn's opening out."""
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Hi"}]}
    _, _, opened = post(live, "/tokenize", body)
    _, _, closed = post(live, "/tokenize", {**body, "add_generation_prompt": False})
    assert closed["count"] < opened["count"]
    assert opened["tokens"][: closed["count"]] == closed["tokens"]


def test_a_completion_prompt_round_trips_and_content_is_an_alias(live, orm):
    """Plain text: detokenize(tokenize(text)) is the text; llama.cpp's
    `content` counts as `prompt` does, at the root and under /v1/; the
    count is a completion's usage.prompt_tokens."""
    text = "The lighthouse keeper counted 42 ships, then went to sleep."
    _, _, tokens = post(live, "/tokenize", {"model": CHAT, "prompt": text})
    _, _, aliased = post(live, "/v1/tokenize", {"model": CHAT, "content": text})
    assert aliased == tokens
    completion = live.client().completions.create(
        model=CHAT, prompt=text, max_tokens=1, temperature=0
    )
    assert tokens["count"] == completion.usage.prompt_tokens
    status, _, answer = post(
        live, "/detokenize", {"model": CHAT, "tokens": tokens["tokens"]}
    )
    assert status == 200, answer
    assert answer == {"prompt": text}
    _, _, again = post(
        live, "/v1/detokenize", {"model": CHAT, "tokens": tokens["tokens"]}
    )
    assert again == answer
    wait_for_usage(endpoint="detokenize", status=200)


def test_tokenize_refusals(live, orm):
    """A token list over the cap is refused (400) before any engine sees it,
    and an id past the vocabulary by the engine (400); an unknown model is
    404; an embedding model a task mismatch (400); both prompt and messages
    400. Each a usage row of its endpoint."""
    too_many = {"model": CHAT, "tokens": [1] * (MAX_PROMPT_TOKENS + 1)}
    status, _, answer = post(live, "/detokenize", too_many)
    assert status == 400, answer
    assert answer["error"]["param"] == "tokens"
    status, _, answer = post(live, "/detokenize", {"model": CHAT, "tokens": [10**8]})
    assert status == 400
    assert "token ids are below" in answer["error"]["message"]
    status, _, answer = post(live, "/tokenize", {"model": "no-such", "prompt": "x"})
    assert status == 404, answer
    status, _, answer = post(live, "/tokenize", {"model": EMBEDDER, "prompt": "x"})
    assert status == 400
    assert answer["error"]["code"] == "model_task_mismatch"
    assert "/tokenize" in answer["error"]["message"]
    both = {"model": CHAT, "prompt": "x", "messages": [{"role": "user"}]}
    assert post(live, "/tokenize", both)[0] == 400
    # The control: the same key and model are served.
    assert post(live, "/tokenize", {"model": CHAT, "prompt": "x"})[0] == 200
    row = wait_for_usage(endpoint="detokenize", status=400)
    assert row.error_code


# -- rerank ------------------------------------------------------------------------

QUERIES = [
    (
        "How do I bake bread at home?",
        [
            "The stock market fell sharply on Tuesday.",
            "Mix flour, water, yeast and salt, let the dough rise, then bake it.",
            "Penguins live in the southern hemisphere.",
        ],
        1,
    ),
    (
        "What is the capital of France?",
        [
            "Paris is the capital and largest city of France.",
            "Bananas are rich in potassium.",
            "The football match ended in a draw.",
        ],
        0,
    ),
    (
        "Which planet is known as the red planet?",
        [
            "A good night's sleep improves memory.",
            "Tax returns are due in April.",
            "Mars is called the red planet because of its rusty surface.",
        ],
        2,
    ),
]


def test_minilm_ranks_the_relevant_document_first(live, orm):
    """An embedding model reranks by cosine similarity: for three hand-written
    queries the relevant document comes first, the results sorted by score,
    each with its text (/v1's default) and the tokens counted."""
    for query, documents, relevant in QUERIES:
        status, headers, answer = post(
            live,
            "/v1/rerank",
            {"model": EMBEDDER, "query": query, "documents": documents},
        )
        assert status == 200, answer
        results = answer["results"]
        assert [r["index"] for r in results][0] == relevant
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        assert sorted(r["index"] for r in results) == [0, 1, 2]
        assert results[0]["document"] == {"text": documents[relevant]}
        assert answer["model"] == EMBEDDER
        assert answer["usage"]["total_tokens"] > len(query.split())
        assert headers["X-Roundhouse-Engine"] == ENGINE
    row = wait_for_usage(endpoint="rerank", status=200, model=EMBEDDER)
    assert row.prompt_tokens > 0


def test_top_n_return_documents_and_the_v2_shape(live):
    """top_n keeps the best; return_documents false leaves the texts out;
    documents may be {text} objects; /v2/rerank answers Cohere's v2 shape
    (no texts unless asked, billed search units)."""
    query, documents, relevant = QUERIES[1]
    objects = [{"text": document} for document in documents]
    _, _, answer = post(
        live,
        "/v1/rerank",
        {
            "model": EMBEDDER,
            "query": query,
            "documents": objects,
            "top_n": 1,
            "return_documents": False,
        },
    )
    assert answer["results"] == [
        {"index": relevant, "relevance_score": answer["results"][0]["relevance_score"]}
    ]
    status, _, v2 = post(
        live,
        "/v2/rerank",
        {"model": EMBEDDER, "query": query, "documents": documents, "top_n": 2},
    )
    assert status == 200, v2
    assert set(v2) == {"id", "results", "meta"}
    assert [r["index"] for r in v2["results"]][0] == relevant
    assert len(v2["results"]) == 2 and "document" not in v2["results"][0]
    assert v2["meta"] == {"billed_units": {"search_units": 1}}


def test_a_cross_encoder_scores_as_sentence_transformers_does(live, reranker_path):
    """A catalog model of the rerank task is served by a CrossEncoder: the
    scores are those of the same model loaded in this process."""
    from sentence_transformers import CrossEncoder

    query, documents, _ = QUERIES[2]
    status, _, answer = post(
        live,
        "/v1/rerank",
        {"model": RERANKER, "query": query, "documents": documents},
    )
    assert status == 200, answer
    expected = CrossEncoder(str(reranker_path), device="cpu").predict(
        [(query, document) for document in documents]
    )
    got = np.zeros(len(documents))
    for result in answer["results"]:
        got[result["index"]] = result["relevance_score"]
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_concurrent_rerank_calls_share_a_batch(live):
    """Eight callers at once: the cross-encoder scores their pairs in fewer
    passes than calls, one pass holding several callers' documents."""
    query, documents, _ = QUERIES[0]
    body = {"model": RERANKER, "query": query, "documents": documents}
    post(live, "/v1/rerank", body)  # loaded: the callers below only queue

    def model_state():
        return next(m for m in live.engine().state().models if m.name == RERANKER)

    before = model_state().batches
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(live, "/v1/rerank", body), range(8)))
    assert all(status == 200 for status, _, _ in answers)
    state = model_state()
    assert state.batches - before < 8
    assert state.largest_batch > len(documents)


def test_rerank_refusals(live):
    """No documents, more than the cap, a chat model (task mismatch) and an
    unknown model are refused in OpenAI's error shape; the control is
    served."""
    base = {"model": EMBEDDER, "query": "q"}
    status, _, answer = post(live, "/v1/rerank", {**base, "documents": []})
    assert status == 400 and answer["error"]["param"] == "documents"
    many = {**base, "documents": ["x"] * 10_001}
    status, _, answer = post(live, "/v1/rerank", many)
    assert status == 400 and answer["error"]["param"] == "documents"
    status, _, answer = post(
        live, "/v2/rerank", {**base, "model": CHAT, "documents": ["x"]}
    )
    assert status == 400 and answer["error"]["code"] == "model_task_mismatch"
    status, _, _ = post(
        live, "/v1/rerank", {**base, "model": "nope", "documents": ["x"]}
    )
    assert status == 404
    assert post(live, "/v1/rerank", {**base, "documents": ["x"]})[0] == 200
