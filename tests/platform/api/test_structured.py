"""Structured output, tool calls, log-probabilities and several choices end to
end: the official `openai` client and its own helpers (`.parse()`, the
streaming helper, `pydantic_function_tool`) against a live front and a real
engine serving the bundled SmolLM2 twice, through llama.cpp (GGUF) and
through transformers."""

import json
import math

import llama_cpp
import openai
import pytest
from pydantic import BaseModel

from catalog.models import ModelConfig
from fleet.models import EngineSpec
from tests.platform import live_platform
from tests.platform.live_platform import CHAT, ENGINE, start_live, wait_for_usage
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
orm = live_platform.orm

HF = "smollm2-via-transformers"
BOTH = pytest.mark.parametrize("model", [CHAT, HF])


def _transformers_model() -> None:
    EngineSpec.objects.filter(name=ENGINE).update(
        capabilities=["gguf", "embedding", "transformers"]
    )
    ModelConfig.objects.create(
        name=HF,
        format="transformers",
        task="chat",
        path="SmolLM2-135M-Instruct.Q4_1.gguf",
        context_length=1024,
        slots=4,
    )


@pytest.fixture(scope="module")
def live(database, django_db_blocker, tmp_path_factory, models_dir_path):
    tmp = tmp_path_factory.mktemp("live-structured")
    with start_live(
        django_db_blocker, tmp, models_dir_path, more_rows=_transformers_model
    ) as platform:
        yield platform


class Pet(BaseModel):
    kind: str
    name: str


class Person(BaseModel):
    name: str
    age: int
    pets: list[Pet]


class Weather(BaseModel):
    """Today's weather in a city."""

    city: str
    unit: str


ASK_PERSON = [
    {"role": "system", "content": "Answer in JSON."},
    {"role": "user", "content": "Invent a person who has one pet."},
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- structured output ------------------------------------------------------------


@BOTH
def test_parse_returns_the_nested_model(live, model):
    """`.parse()` with a nested pydantic model: the answer parses into it."""
    completion = live.client().chat.completions.parse(
        model=model,
        messages=ASK_PERSON,
        response_format=Person,
        temperature=0,
        max_tokens=300,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    person = choice.message.parsed
    assert isinstance(person, Person)
    assert all(isinstance(pet, Pet) for pet in person.pets)
    assert Person.model_validate_json(choice.message.content) == person


def test_unconstrained_answer_is_not_that_json(live):
    """The control: the same request without a response format does not
    answer with a Person, so the test above can fail."""
    completion = live.client().chat.completions.create(
        model=CHAT, messages=ASK_PERSON, temperature=0, max_tokens=300
    )
    with pytest.raises(ValueError):
        Person.model_validate_json(completion.choices[0].message.content)


@BOTH
def test_json_object_streams_parseable_json(live, model):
    """`json_object`, streamed: the text put together is one JSON object."""
    ask = 'Give JSON with keys "name" and "age" for Alice, who is 30.'
    stream = live.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ask}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=300,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_streaming_helper_parses_too(live):
    """The client's streaming helper with a pydantic response format."""
    with live.client().chat.completions.stream(
        model=CHAT,
        messages=ASK_PERSON,
        response_format=Person,
        temperature=0,
        max_tokens=300,
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)


def test_completions_take_a_response_format_too(live):
    """/v1/completions' `response_format` (vLLM's and llama.cpp server's
    extension): the text is the schema's JSON."""
    completion = live.client().completions.create(
        model=CHAT,
        prompt="A pet, as JSON:",
        max_tokens=300,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "pet",
                    "schema": {
                        **Pet.model_json_schema(),
                        "additionalProperties": False,
                    },
                },
            }
        },
    )
    Pet.model_validate_json(completion.choices[0].text)


def test_unsupported_schema_feature_is_a_400_naming_it(live):
    """A schema keyword the grammar library does not implement is refused
    before anything is generated, naming the keyword."""
    with pytest.raises(openai.BadRequestError) as refused:
        live.client().chat.completions.create(
            model=CHAT,
            messages=ASK_PERSON,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "conditional",
                    "schema": {
                        "type": "object",
                        "if": {"properties": {"a": {"const": 1}}},
                        "then": {"required": ["b"]},
                    },
                },
            },
        )
    assert "if" in refused.value.message and "then" in refused.value.message


# -- tool calls ----------------------------------------------------------------------


@BOTH
def test_forced_tool_call_matches_the_tool_schema(live, model):
    """A named tool choice: one call of that function whose arguments
    validate against its schema; finish reason tool_calls, no content."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    completion = live.client().chat.completions.create(
        model=model,
        messages=ASK_WEATHER,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)


@BOTH
def test_required_tool_call_streams_deltas(live, model):
    """`required`, streamed: the call's id, type and name come first, its
    arguments in pieces that put together validate against the tool."""
    tools = [
        openai.pydantic_function_tool(Weather, name="get_weather"),
        openai.pydantic_function_tool(Pet, name="adopt_pet"),
    ]
    stream = live.client().chat.completions.create(
        model=model,
        messages=ASK_WEATHER,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
        stream=True,
    )
    deltas = [
        call
        for chunk in stream
        if chunk.choices
        for call in chunk.choices[0].delta.tool_calls or ()
    ]
    assert len(deltas) > 2  # the arguments came in pieces
    first = deltas[0]
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name in ("get_weather", "adopt_pet")
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    schema = Weather if first.function.name == "get_weather" else Pet
    schema.model_validate_json(arguments)


def test_a_tool_round_trip(live):
    """The call sent back as the client returned it, with the tool's result:
    the history is accepted and the model answers in text (choice auto)."""
    client = live.client()
    tools = [openai.pydantic_function_tool(Weather, name="get_weather")]
    asked = client.chat.completions.create(
        model=CHAT,
        messages=ASK_WEATHER,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    message = asked.choices[0].message
    [call] = message.tool_calls
    history = [
        *ASK_WEATHER,
        message,
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answered = client.chat.completions.create(
        model=CHAT,
        messages=history,
        tools=tools,
        tool_choice="none",
        temperature=0,
        max_tokens=30,
    )
    assert answered.choices[0].message.content
    assert answered.choices[0].message.tool_calls is None


# -- log-probabilities ---------------------------------------------------------------


@BOTH
def test_chat_logprobs_are_consistent(live, model):
    """Each token: log-probability <= 0, its top alternatives sorted with
    probabilities summing to at most 1, its bytes its text; the tokens
    spell the answer; streamed and whole agree (greedy)."""
    fields = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "temperature": 0,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 5,
    }
    completion = live.client().chat.completions.create(**fields)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert sum(math.exp(lp) for lp in tops) <= 1 + 1e-6
        # Greedy: the chosen token is the likeliest.
        assert entry.token == entry.top_logprobs[0].token
        assert abs(entry.logprob - tops[0]) < 1e-6
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    spelled = "".join(entry.token for entry in entries)
    assert spelled.startswith(completion.choices[0].message.content)
    streamed = [
        entry
        for chunk in live.client().chat.completions.create(**fields, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]
    for one, other in zip(streamed, entries, strict=True):
        assert abs(one.logprob - other.logprob) < 1e-3


def test_completion_logprobs_in_the_legacy_shape(live):
    """/v1/completions' `logprobs: 2`: tokens, their log-probabilities, the
    top two of each as a mapping, and text offsets into the answer."""
    completion = live.client().completions.create(
        model=CHAT,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=6,
        logprobs=2,
    )
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens).startswith(choice.text)
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == 6
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert all(offsets[i + 1] == offsets[i] + len(logprobs.tokens[i]) for i in range(5))


@BOTH
def test_echo_with_logprobs_scores_the_prompt(live, model):
    """echo with logprobs: the prompt's tokens come first, the first with no
    log-probability; each next one's distribution is the one the model gives
    for the next token after the prompt so far (checked against a request
    that stops there), and the offsets follow the echoed text."""
    client = live.client()
    whole = client.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=5,
    )
    choice = whole.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert choice.text.startswith("The capital of France is")
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    offsets = logprobs.text_offset
    assert offsets == [
        len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))
    ]
    # The entry of " is" is what the model says after "The capital of France".
    at = logprobs.tokens.index(" is")
    shorter = client.completions.create(
        model=model,
        prompt="The capital of France",
        max_tokens=1,
        temperature=0,
        logprobs=5,
    )
    expected = shorter.choices[0].logprobs.top_logprobs[0]
    got = logprobs.top_logprobs[at]
    assert set(got) == set(expected)
    assert all(abs(got[token] - expected[token]) < 0.05 for token in got)
    streamed = list(
        client.completions.create(
            model=model,
            prompt="The capital of France is",
            max_tokens=2,
            temperature=0,
            echo=True,
            logprobs=5,
            stream=True,
        )
    )
    first = streamed[0].choices[0]
    assert first.text == "The capital of France is"
    assert first.logprobs.tokens == logprobs.tokens[: len(first.logprobs.tokens)]


# -- several choices, echo, prompt lists ----------------------------------------------


@BOTH
def test_n_gives_distinct_seeded_choices(live, model):
    """n=3 with a seed: three distinct choices (the seed moves on by one per
    choice); usage counts every choice's tokens and the prompt once."""
    fields = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something surprising."}],
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 12,
        "n": 3,
    }
    one = live.client().chat.completions.create(**fields)
    texts = [choice.message.content for choice in one.choices]
    assert [choice.index for choice in one.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    alone = live.client().chat.completions.create(**{**fields, "n": 1})
    assert one.usage.prompt_tokens == alone.usage.prompt_tokens
    assert one.usage.completion_tokens <= 3 * 12
    assert one.usage.completion_tokens > 12


def test_n_streams_interleave_by_index(live):
    """A streamed n=2: chunks of both choices, each choice ending once."""
    stream = live.client().chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Count to five."}],
        temperature=1.0,
        seed=3,
        max_tokens=10,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = {0: "", 1: ""}
    ends = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                ends.append(choice.index)
    assert sorted(ends) == [0, 1]
    assert texts[0] and texts[1]
    assert chunks[-1].usage.completion_tokens > 10


def _busy(live) -> int:
    models = live.engine().state().models
    model = next(m for m in models if m.name == CHAT)
    return model.busy + model.queued


def test_hanging_up_on_several_choices_cancels_them_all(live, orm):
    """A client that leaves a streamed n=2 answer: both choices' requests end
    in the engine (busy two while read, none after), and the call is
    recorded as hung up with the tokens it had sent."""
    stream = live.client().chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Write a very long story."}],
        temperature=1.0,
        max_tokens=900,
        n=2,
        stream=True,
    )
    seen = set()
    for chunk in stream:
        seen.update(choice.index for choice in chunk.choices)
        if seen == {0, 1}:
            break
    assert _busy(live) == 2
    stream.close()
    # Left running, 2 x 900 tokens take over a minute here.
    wait_for(lambda: _busy(live) == 0, timeout=15, what="both requests to end")
    row = wait_for_usage(endpoint="chat.completions", status=499)
    assert 2 <= row.completion_tokens < 200


def test_completions_echo_and_prompt_lists(live, models_dir_path):
    """echo puts the prompt before the answer; a list of prompts (texts or
    token arrays) gives one choice each, in order."""
    client = live.client()
    echoed = client.completions.create(
        model=CHAT, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True
    )
    plain = client.completions.create(
        model=CHAT, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    vocabulary = llama_cpp.Llama(
        model_path=str(models_dir_path / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        vocab_only=True,
        verbose=False,
    )
    arrays = [
        vocabulary.tokenize(text.encode(), add_bos=False)
        for text in ("Once upon a time", "The sea is")
    ]
    texts = ["Once upon a time", "The sea is"]
    for prompt in (arrays, texts):
        listed = client.completions.create(
            model=CHAT, prompt=prompt, max_tokens=5, temperature=0, echo=True
        )
        # Run side by side, greedy answers may part where two tokens are
        # nearly tied (batched arithmetic): only the echoed prompts are exact.
        assert [choice.index for choice in listed.choices] == [0, 1]
        for choice, text in zip(listed.choices, texts, strict=True):
            assert choice.text.startswith(text) and len(choice.text) > len(text)


# -- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 9}, "n"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_inconsistent_fields_are_400_naming_the_field(live, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        live.client().chat.completions.create(
            model=CHAT, messages=ASK_WEATHER, max_tokens=5, **fields
        )
    assert refused.value.body["param"] == param
