"""Ollama's `keep_alive` applied to residency, end to end with the official
`ollama` client: a request's keep-alive is how long its model then stays
(the engine's state and /api/ps tell it), an empty prompt loads the model
ahead and with keep_alive 0 unloads it, /api/embed's keep_alive 0 unloads
the embedder after it, and `load_duration` tells a load apart. A live front
and a real engine of its own (SmolLM2 and MiniLM, catalog keep-alive
300 s), since these tests unload the models the other Ollama tests use."""

import ollama

from tests.platform import live_platform
from tests.platform.live_platform import CHAT, EMBEDDER
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live

HELLO = [{"role": "user", "content": "Say hello."}]
SHORT = {"num_predict": 2}
CATALOG_KEEP_ALIVE_S = 300  # ModelConfig's default


def client(live) -> ollama.Client:
    return ollama.Client(
        host=live.base_url,
        headers={"Authorization": f"Bearer {live.keys['main']}"},
        timeout=120,
    )


def resident(live) -> dict:
    """The engine's resident models, by name, as it describes them."""
    return {model.name: model for model in live.engine().state().models}


def unload_and_wait(live, model: str) -> None:
    client(live).generate(model=model, prompt="", keep_alive=0)
    wait_for(lambda: model not in resident(live), timeout=60, what=f"{model} unloaded")


def test_an_empty_prompt_loads_ahead_and_keep_alive_0_unloads(live):
    """Ollama's documented load and unload: generate with an empty prompt
    loads the model (done_reason `load`, the model then resident: the
    control that the unload's check can fail); with keep_alive 0 it unloads
    it (done_reason `unload`, the model gone from the engine). /api/chat
    with no messages does the same."""
    loaded = client(live).generate(model=CHAT, prompt="", keep_alive="10m")
    assert loaded.done and loaded.done_reason == "load"
    assert resident(live)[CHAT].keep_alive_s == 600
    unloaded = client(live).generate(model=CHAT, prompt="", keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload"
    wait_for(lambda: CHAT not in resident(live), timeout=60, what="chat unloaded")
    chat_loaded = client(live).chat(model=CHAT, messages=[])
    assert chat_loaded.done_reason == "load" and CHAT in resident(live)
    client(live).chat(model=CHAT, messages=[], keep_alive=0)
    wait_for(lambda: CHAT not in resident(live), timeout=60, what="chat unloaded")


def test_a_requests_keep_alive_is_how_long_its_model_then_stays(live):
    """Each request sets how long its model may then stay idle, as the
    engine reports it and /api/ps shows it: "10m" 600 s; -1 no limit (ps:
    an expiry centuries away); a request without one the catalog's own."""
    client(live).chat(model=CHAT, messages=HELLO, options=SHORT, keep_alive="10m")
    assert resident(live)[CHAT].keep_alive_s == 600
    client(live).chat(model=CHAT, messages=HELLO, options=SHORT, keep_alive=-1)
    assert resident(live)[CHAT].keep_alive_s is None

    def forever():
        found = [m for m in client(live).ps().models if m.model == CHAT]
        return found and found[0].expires_at.year >= 2300

    wait_for(forever, timeout=30, what="/api/ps: no expiry")
    client(live).chat(model=CHAT, messages=HELLO, options=SHORT)
    assert resident(live)[CHAT].keep_alive_s == CATALOG_KEEP_ALIVE_S
    wait_for(lambda: not forever(), timeout=30, what="/api/ps: an expiry again")


def test_an_embed_with_keep_alive_0_unloads_the_embedder_after_it(live):
    """/api/embed with keep_alive 0 answers, then the embedder is unloaded;
    the control, an embed without it, leaves the embedder resident."""
    first = client(live).embed(model=EMBEDDER, input="one")
    assert first.embeddings and EMBEDDER in resident(live)
    assert resident(live)[EMBEDDER].keep_alive_s == CATALOG_KEEP_ALIVE_S
    last = client(live).embed(model=EMBEDDER, input="two", keep_alive=0)
    assert last.embeddings
    wait_for(
        lambda: EMBEDDER not in resident(live), timeout=60, what="embedder unloaded"
    )


def test_load_duration_tells_a_load_apart(live):
    """A request that had to load its model reports the load in
    load_duration; the next, the model resident, reports 0 (for a chat and
    an embed alike)."""
    unload_and_wait(live, CHAT)
    loading = client(live).chat(model=CHAT, messages=HELLO, options=SHORT)
    assert loading.load_duration > 0
    assert loading.total_duration > loading.load_duration
    resident_answer = client(live).chat(model=CHAT, messages=HELLO, options=SHORT)
    assert resident_answer.load_duration == 0
    client(live).embed(model=EMBEDDER, input="one", keep_alive=0)
    wait_for(
        lambda: EMBEDDER not in resident(live), timeout=60, what="embedder unloaded"
    )
    assert client(live).embed(model=EMBEDDER, input="one").load_duration > 0
    assert client(live).embed(model=EMBEDDER, input="one").load_duration == 0
