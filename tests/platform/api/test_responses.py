"""OpenAI's Responses API end to end: the official `openai` client against a
live front and a real engine serving the bundled SmolLM2 (the live platform
of test_openai, started once for this module). Answers are greedy
(temperature 0) and short."""

import json
import os
import signal

import openai
import pydantic
import pytest

from api.models import StoredResponse
from tests.platform import live_platform
from tests.platform.live_platform import CHAT, EMBEDDER, ENGINE, wait_for_usage
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# The events of a streamed text answer, in OpenAI's order (deltas collapsed).
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def collapsed(kinds: list[str]) -> list[str]:
    """Event types with runs of the same type as one."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def test_a_string_input_is_answered_as_a_response(live, orm):
    """A string input: a Response object with one assistant message whose
    text the client joins into output_text; usage in the Responses shape;
    the usage row's endpoint is "responses"; the engine named in a header."""
    client = live.client()
    raw = client.responses.with_raw_response.create(
        model=CHAT,
        input="Name a colour.",
        instructions="Answer in one word.",
        max_output_tokens=6,
        temperature=0,
    )
    assert raw.headers["x-roundhouse-engine"] == ENGINE
    reply = raw.parse()
    assert reply.id.startswith("resp_")
    assert reply.object == "response"
    assert reply.status in ("completed", "incomplete")
    assert reply.model == CHAT
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert reply.output_text == message.content[0].text
    assert reply.output_text
    assert reply.instructions == "Answer in one word."
    usage = reply.usage
    assert 0 < usage.output_tokens <= 6
    assert usage.input_tokens > 5
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    row = wait_for_usage(endpoint="responses", key__name="main", status=200)
    assert row.prompt_tokens == usage.input_tokens
    assert row.completion_tokens == usage.output_tokens
    assert row.engine == ENGINE


def test_input_items_are_the_conversation(live):
    """Input as items: messages with input_text parts and an earlier
    assistant answer; the model sees them as one chat (more input tokens
    than the last message alone, the control)."""
    last = {
        "role": "user",
        "content": [{"type": "input_text", "text": "And its capital?"}],
    }
    items = [
        {"type": "message", "role": "user", "content": "Name a country."},
        {"role": "assistant", "content": "France."},
        last,
    ]
    client = live.client()
    whole = client.responses.create(
        model=CHAT, input=items, max_output_tokens=4, temperature=0, store=False
    )
    alone = client.responses.create(
        model=CHAT, input=[last], max_output_tokens=4, temperature=0, store=False
    )
    assert whole.output_text
    assert whole.usage.input_tokens > alone.usage.input_tokens


def test_a_stream_sends_the_semantic_events_in_order(live):
    """responses.stream: the events in OpenAI's order, each numbered one
    after the other; the deltas joined are the final output_text, which is
    the same greedy answer as unstreamed."""
    fields = {
        "model": CHAT,
        "input": "Say hello.",
        "max_output_tokens": 8,
        "temperature": 0,
        "store": False,
    }
    client = live.client()
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = (
            stream.get_final_response()
            if events[-1].type.endswith("completed")
            else events[-1].response
        )
    kinds = [event.type for event in events]
    assert collapsed(kinds)[: len(TEXT_EVENTS)] == TEXT_EVENTS
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    plain = client.responses.create(**fields)
    assert plain.output_text == deltas
    assert final.usage.output_tokens == plain.usage.output_tokens


class Colour(pydantic.BaseModel):
    name: str
    hex_code: str


def test_parse_with_a_pydantic_model(live):
    """responses.parse with text_format: the answer is held to the model's
    JSON schema (text.format json_schema) and parsed by the client."""
    reply = live.client().responses.parse(
        model=CHAT,
        input="Give a colour and its hex code.",
        text_format=Colour,
        max_output_tokens=60,
        temperature=0,
        store=False,
    )
    assert reply.text.format.type == "json_schema"
    assert isinstance(reply.output_parsed, Colour)


def test_a_function_call_round_trip(live):
    """tool_choice forces the function: the answer is a function_call item
    with a call id and JSON arguments; its output sent back (chained with
    previous_response_id) is answered with text. The same round trip as
    items without chaining works too; an output for a call never made is
    refused (the control)."""
    client = live.client()
    called = client.responses.create(
        model=CHAT,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather"
    assert call.call_id
    assert "city" in json.loads(call.arguments)
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"temperature_c": 21, "sky": "clear"}',
    }
    answered = client.responses.create(
        model=CHAT,
        previous_response_id=called.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=20,
        temperature=0,
    )
    assert answered.previous_response_id == called.id
    assert answered.output_text
    as_items = client.responses.create(
        model=CHAT,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            result,
        ],
        tools=[WEATHER],
        max_output_tokens=20,
        temperature=0,
        store=False,
    )
    assert as_items.output_text
    with pytest.raises(openai.BadRequestError, match="No tool call found"):
        client.responses.create(model=CHAT, input=[result], store=False)


def test_a_streamed_function_call(live):
    """A forced call streamed: each call's item added, its arguments in
    deltas that join into its done event's arguments, then the item done;
    the completed response holds the same calls."""
    events = list(
        live.client().responses.create(
            model=CHAT,
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            max_output_tokens=100,
            temperature=0,
            stream=True,
            store=False,
        )
    )
    kinds = collapsed([event.type for event in events])
    per_call = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    calls = (len(kinds) - 3) // len(per_call)
    assert calls >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        *per_call * calls,
        "response.completed",
    ], [e for e in events if e.type == "error"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    for call in done:
        deltas = "".join(
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta"
            and e.item_id == call.item_id
        )
        assert call.arguments == deltas
        assert call.name == "get_weather"
    final = events[-1].response.output
    assert [item.arguments for item in final] == [call.arguments for call in done]


def test_a_chained_turn_reuses_the_prompt_cache(live):
    """previous_response_id: the second turn has the first turn's input and
    output before its own, which the engine finds in its prompt cache
    (cached_tokens > 0). The control: the same input without it has none of
    the history (fewer input tokens)."""
    client = live.client()
    first = client.responses.create(
        model=CHAT,
        input="Describe a lighthouse keeper's morning in detail.",
        max_output_tokens=12,
        temperature=0,
    )
    second = client.responses.create(
        model=CHAT,
        previous_response_id=first.id,
        input="And the evening?",
        max_output_tokens=4,
        temperature=0,
    )
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens > first.usage.input_tokens
    alone = client.responses.create(
        model=CHAT,
        input="And the evening?",
        max_output_tokens=4,
        temperature=0,
        store=False,
    )
    assert alone.usage.input_tokens < first.usage.input_tokens


def test_a_stored_response_is_retrieved_listed_and_deleted(live, orm):
    """A stored response reads back as answered; its input items list in
    OpenAI's order (desc by default) and page; deleted, it is gone (404)."""
    client = live.client()
    reply = client.responses.create(
        model=CHAT,
        input=[
            {"role": "user", "content": "One."},
            {"role": "assistant", "content": "Two."},
            {"role": "user", "content": "Three?"},
        ],
        max_output_tokens=3,
        temperature=0,
        metadata={"topic": "counting"},
    )
    again = client.responses.retrieve(reply.id)
    assert again.model_dump() == reply.model_dump()
    assert again.metadata == {"topic": "counting"}
    items = client.responses.input_items.list(reply.id)
    texts = [item.content[0].text for item in items.data]
    assert texts == ["Three?", "Two.", "One."]
    ascending = client.responses.input_items.list(reply.id, order="asc", limit=2)
    assert [item.content[0].text for item in ascending.data] == ["One.", "Two."]
    assert ascending.has_more
    client.responses.delete(reply.id)
    assert not StoredResponse.objects.filter(id=reply.id).exists()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)


def test_a_chained_responses_input_items_are_the_whole_chain(live):
    """A response chained with previous_response_id lists as its input
    items every earlier turn's input and output, then its own, as OpenAI
    does, paged by limit and after in either order. The control: the first
    turn lists its own input alone."""
    client = live.client()
    fields = {"model": CHAT, "max_output_tokens": 3, "temperature": 0}
    first = client.responses.create(input="One.", **fields)
    second = client.responses.create(
        input="Two.", previous_response_id=first.id, **fields
    )
    third = client.responses.create(
        input="Three.", previous_response_id=second.id, **fields
    )

    def texts(page) -> list[str]:
        return [item.content[0].text for item in page.data]

    assert texts(client.responses.input_items.list(first.id)) == ["One."]
    chain = [
        "One.",
        first.output_text,
        "Two.",
        second.output_text,
        "Three.",
    ]
    listed = client.responses.input_items.list(third.id, order="asc")
    assert texts(listed) == chain
    assert listed.data[1].role == "assistant"
    assert listed.data[1].id == first.output[0].id
    newest = client.responses.input_items.list(third.id, limit=2)
    assert texts(newest) == chain[::-1][:2] and newest.has_more
    rest = client.responses.input_items.list(third.id, limit=10, after=newest.last_id)
    assert texts(rest) == chain[::-1][2:] and not rest.has_more
    # The client's own paging walks the whole chain too.
    walked = client.responses.input_items.list(third.id, order="asc", limit=2)
    assert [item.content[0].text for item in walked] == chain


def test_another_key_cannot_read_or_chain_a_stored_response(live):
    """A stored response is its key's: another key reading, listing,
    deleting or chaining onto it gets a 404, as for one that does not exist;
    its owner still reads it (the control)."""
    owner = live.client()
    reply = owner.responses.create(
        model=CHAT, input="Hello.", max_output_tokens=2, temperature=0
    )
    other = live.client("fallback")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(reply.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError) as refused:
        other.responses.create(
            model=CHAT, previous_response_id=reply.id, input="More.", store=False
        )
    assert refused.value.body["code"] == "previous_response_not_found"
    assert owner.responses.retrieve(reply.id).id == reply.id


def test_store_false_is_not_kept(live, orm):
    """store=false: answered, never stored, so not retrievable."""
    reply = live.client().responses.create(
        model=CHAT, input="Hi.", max_output_tokens=2, temperature=0, store=False
    )
    assert reply.store is False
    assert not StoredResponse.objects.filter(id=reply.id).exists()
    with pytest.raises(openai.NotFoundError):
        live.client().responses.retrieve(reply.id)


def test_what_roundhouse_cannot_honour_is_refused(live):
    """A built-in tool, reasoning effort, and an embedding model: 400s that
    say why, in OpenAI's error shape."""
    client = live.client()
    with pytest.raises(openai.BadRequestError) as tool:
        client.responses.create(
            model=CHAT, input="Search.", tools=[{"type": "web_search"}]
        )
    assert "web_search" in tool.value.message
    assert tool.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as reasoning:
        client.responses.create(model=CHAT, input="x", reasoning={"effort": "high"})
    assert reasoning.value.body["param"] == "reasoning.effort"
    with pytest.raises(openai.BadRequestError) as task:
        client.responses.create(model=EMBEDDER, input="x")
    assert task.value.body["code"] == "model_task_mismatch"


def test_a_hang_up_mid_stream_frees_the_engine_slot(live, orm):
    """The client hangs up after a few events of a long answer: the engine
    cancels it (its slot frees long before 400 tokens), and the usage row
    records the hang-up."""
    engine = live.engine()
    stream = live.client().responses.create(
        model=CHAT,
        input="Write a very long essay.",
        max_output_tokens=400,
        stream=True,
        store=False,
    )
    events = iter(stream)
    while next(events).type != "response.output_text.delta":
        pass
    assert engine.state().slots_in_use == 1
    stream.close()
    wait_for(
        lambda: engine.state().slots_in_use == 0, timeout=10, what="the slot freed"
    )
    row = wait_for_usage(endpoint="responses", status=499)
    assert row.error_code == "client_closed"


def test_a_hang_up_mid_stream_is_stored_incomplete(live, orm):
    """A stored (store=true) stream whose client hangs up is kept as
    incomplete, reason client_disconnected, with the text said before it
    (the stored text begins with the deltas the client read)."""
    stream = live.client().responses.create(
        model=CHAT,
        input="Write a very long essay.",
        max_output_tokens=400,
        stream=True,
    )
    events = iter(stream)
    created = next(events)
    said = ""
    while len(said) < 10:
        event = next(events)
        if event.type == "response.output_text.delta":
            said += event.delta
    stream.close()
    stored = wait_for(
        lambda: StoredResponse.objects.filter(id=created.response.id).first(),
        timeout=30,
        what="the cut-off response stored",
    )
    again = live.client().responses.retrieve(stored.id)
    assert again.status == "incomplete"
    assert again.incomplete_details.reason == "client_disconnected"
    assert again.output_text.startswith(said)
    assert again.output[0].status == "incomplete"


def test_an_engine_failing_mid_stream_ends_it_failed_and_stored_so(live, orm):
    """The engine is killed while it streams: the stream ends with an `error`
    event (engine_died), then `response.failed`; the stored response reads
    back failed, with that error and the text said before it. (The
    supervisor starts the engine again for the tests after this one.)"""
    engine = live.engine()
    stream = live.client().responses.create(
        model=CHAT,
        input="Write a very long essay.",
        max_output_tokens=400,
        stream=True,
    )
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            break
    os.kill(engine.state().pid, signal.SIGKILL)
    events.extend(stream)
    kinds = [event.type for event in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2].code == "engine_died"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "engine_died"
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    stored = live.client().responses.retrieve(failed.id)
    assert stored.status == "failed" and stored.error.code == "engine_died"
    assert said and stored.output_text.startswith(said)

    live.wait_engine_back()
