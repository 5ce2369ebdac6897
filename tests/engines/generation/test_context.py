"""A conversation longer than the model's context, in a real engine: refused
with the counts (context_length_exceeded), or, where the model's setting says
so, answered with its oldest turns dropped, which the answer reports."""

import json

import pytest

from engines.wire.client import EngineRequestError
from engines.wire.requests import GenerateRequest
from tests.conftest import run_python
from tests.engines.conftest import start_engine
from tests.engines.generating import gguf_spec

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REFUSING, DROPPING = "smol-refusing", "smol-dropping"
SYSTEM = "You are a helpful assistant for a harbour office."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = start_engine(
        tmp_path_factory.mktemp("context"),
        models=[
            gguf_spec(REFUSING, FILE, context_length=256, slots=1),
            gguf_spec(
                DROPPING,
                FILE,
                context_length=256,
                slots=1,
                context_overflow="drop_oldest",
            ),
        ],
    )
    yield engine
    engine.stop()


def long_conversation(turns: int) -> list[dict]:
    """A system prompt, then `turns` question/answer pairs of ~30 tokens each,
    then the latest question."""
    messages = [{"role": "system", "content": SYSTEM}]
    for n in range(turns):
        messages.append(
            {"role": "user", "content": f"Question {n}: when does ferry {n} leave?"}
        )
        messages.append(
            {
                "role": "assistant",
                "content": f"Ferry {n} leaves at {n % 12 + 1} o'clock from pier "
                f"{n % 5 + 1}, every day except Sundays.",
            }
        )
    messages.append({"role": "user", "content": "And the last ferry of the day?"})
    return messages


def test_a_long_conversation_is_refused_with_the_counts(engine):
    with pytest.raises(EngineRequestError) as error:
        engine.client().generate(
            GenerateRequest(
                model=REFUSING,
                messages=long_conversation(12),
                max_tokens=8,
                temperature=0,
            )
        )
    assert error.value.code == "context_length_exceeded"
    message = error.value.message
    assert "context holds 256" in message
    count = int(message.split("this prompt has ")[1].split(" tokens")[0])
    assert count > 256


def test_a_conversation_that_fits_is_answered_whole(engine):
    """The control: nothing dropped when it fits, on either setting."""
    for model in (REFUSING, DROPPING):
        reply = engine.client().generate(
            GenerateRequest(
                model=model, messages=long_conversation(1), max_tokens=4, temperature=0
            )
        )
        assert reply.dropped_messages == 0


def test_the_oldest_turns_are_dropped_where_the_model_allows(engine):
    """The oldest question/answer pairs go (never the system prompt, never the
    latest question), as many as needed to leave room for the answer; the
    stream's start frame and the final frame say how many."""
    messages = long_conversation(12)
    frames = list(
        engine.client().generate_stream(
            GenerateRequest(
                model=DROPPING, messages=messages, max_tokens=16, temperature=0
            )
        )
    )
    start, done = frames[0], frames[-1]
    assert start.event == "start" and done.event == "done"
    dropped = start.dropped_messages
    assert dropped == done.dropped_messages
    assert dropped > 0 and dropped % 2 == 0  # whole turns
    assert dropped <= len(messages) - 2
    # Room was left for the answer: prompt plus max_tokens fit the context.
    assert done.usage.prompt_tokens + 16 <= 256
    # The same conversation, cut by hand as the engine did, gives the same
    # prompt: the system prompt stayed, the oldest turns went.
    kept = [messages[0], *messages[1 + dropped :]]
    by_hand = engine.client().generate(
        GenerateRequest(model=REFUSING, messages=kept, max_tokens=16, temperature=0)
    )
    assert by_hand.usage.prompt_tokens == done.usage.prompt_tokens
    assert by_hand.dropped_messages == 0
    # And no more than needed: with one turn fewer dropped, no room is left.
    fuller = [messages[0], *messages[1 + dropped - 2 :]]
    assert prompt_tokens(engine, fuller) + 16 > 256


def prompt_tokens(engine, messages: list[dict]) -> int:
    """The prompt's token count, read from the answer or from the refusal."""
    try:
        reply = engine.client().generate(
            GenerateRequest(model=REFUSING, messages=messages, max_tokens=1)
        )
    except EngineRequestError as error:
        return int(error.message.split("this prompt has ")[1].split(" ")[0])
    return reply.usage.prompt_tokens


def test_what_cannot_fit_even_with_every_turn_dropped_is_refused(engine):
    messages = [
        {"role": "system", "content": "Rules: " + "be kind. " * 200},
        {"role": "user", "content": "Hello?"},
    ]
    with pytest.raises(EngineRequestError) as error:
        engine.client().generate(
            GenerateRequest(model=DROPPING, messages=messages, max_tokens=4)
        )
    assert error.value.code == "context_length_exceeded"
    assert "context holds 256" in error.value.message


ONCE = """
import json
import engines.generation.prompts as prompts
from engines.backends.gguf import LlamaBackend
from engines.generation.context import fit_prompt
from engines.generation.sampling import SamplingParams

backend = LlamaBackend(MODEL, n_slots=1, context_length=256, n_threads=2)
made, renders = [], []
for name, log in (("tool_schema", made), ("tools_instructions", made),
                  ("render_chat", renders)):
    def counted(*args, _original=getattr(prompts, name), _log=log, **kwargs):
        _log.append(1)
        return _original(*args, **kwargs)
    setattr(prompts, name, counted)
message = {"messages": MESSAGES, "tools": [TOOL]}
prompt = fit_prompt(backend, message, SamplingParams(max_tokens=8),
                    policy="drop_oldest")
print(json.dumps({"dropped": prompt.dropped_messages, "renders": len(renders),
                  "made": len(made)}))
"""


def test_tools_are_made_into_prompt_text_once_per_request(models_dir):
    """A chat with tools whose oldest turns are dropped is rendered several
    times; its tools are made into prompt text once (the control: the
    renders are several)."""
    tool = {"name": "ferry_times", "description": "Times", "parameters": {}}
    script = (
        f"MODEL = {str(models_dir / FILE)!r}\n"
        f"MESSAGES = {long_conversation(12)!r}\nTOOL = {tool!r}\n{ONCE}"
    )
    result = run_python(script, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dropped"] > 0 and report["renders"] > 2, report
    assert report["made"] == 1, report
