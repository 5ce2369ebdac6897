"""Constrained answers and tool calls in the engine: the grammar a request
carries, the tools in its prompt, the calls read back from its answer, and
constrained slots in the same continuous batch as free ones."""

import json

import pytest

from engines.constrained.toolcalls import ToolCallStream, template_messages
from engines.wire.client import EngineRequestError
from engines.wire.framing import auth_frame, encode_message
from engines.wire.requests import MAX_TOOLS_CHARS, GenerateRequest
from tests.conftest import run_python
from tests.engines.conftest import start_engine
from tests.engines.generating import gguf_spec
from tests.engines.raw import raw_exchange

SMOL = "smollm2-135m-instruct"
TOOLED = "smollm2-with-a-tools-template"
# A template that renders tools itself (the shape of Qwen2.5's, shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>"
    "{{ call.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)
WEATHER = {
    "name": "get_weather",
    "description": "Weather <now> & later",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = start_engine(
        tmp_path_factory.mktemp("constraint"),
        models=[
            gguf_spec(SMOL, "SmolLM2-135M-Instruct.Q4_1.gguf", slots=4),
            gguf_spec(
                TOOLED,
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                slots=1,
                chat_template=TOOLS_TEMPLATE,
            ),
        ],
        preload=[SMOL],
    )
    yield engine
    engine.stop()


# -- reading calls back ------------------------------------------------------------

ANSWER = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris {\\"x\\"}"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": ["UTC", {"dst": true}]}}\n'
    "</tool_call>\n"
)


def _read(pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    stream = ToolCallStream()
    content, deltas = "", []
    for piece in pieces:
        text, more = stream.feed(piece)
        content += text
        deltas += more
    text, more = stream.finish()
    return content + text, deltas + more, stream.calls


def test_calls_read_the_same_however_the_answer_is_split():
    """Whole, or one character at a time: the same content (the space
    between calls dropped) and the same two calls, whose deltas put
    together give their arguments; a brace inside a string ends nothing."""
    whole = _read([ANSWER])
    by_character = _read(list(ANSWER))
    for content, deltas, calls in (whole, by_character):
        assert content == "Let me look.\n"
        assert [call["name"] for call in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0]["arguments"]) == {"city": 'Paris {"x"}'}
        assert json.loads(calls[1]["arguments"]) == {"zone": ["UTC", {"dst": True}]}
        for index, call in enumerate(calls):
            mine = [d for d in deltas if d["index"] == index]
            assert mine[0]["id"] == call["id"] and mine[0]["name"] == call["name"]
            assert "".join(d["arguments"] for d in mine) == call["arguments"]
    # Character by character, the arguments went out in many pieces.
    assert len(by_character[1]) > 10


def test_text_that_only_looks_like_a_tag_is_content():
    content, deltas, calls = _read(list("a <tool is not <tool_call"))
    assert content == "a <tool is not <tool_call" and calls == [] == deltas


def test_a_call_cut_short_keeps_what_was_written():
    content, _, calls = _read(['<tool_call>\n{"name": "f", "arguments": {"a": "un'])
    assert content == ""
    assert calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": "un'


def test_history_for_a_template_without_tools():
    """Past calls become the model's own call text; tool results become one
    user turn (consecutive ones merged: many templates insist on turns
    alternating)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "one", "tool_call_id": "call_1"},
        {"role": "tool", "content": "two", "tool_call_id": "call_1"},
    ]
    plain = template_messages(messages, knows_tools=False)
    assert [m["role"] for m in plain] == ["user", "assistant", "user"]
    assert plain[1]["content"].count('{"name": "f", "arguments": {"a": 1}}') == 2
    assert plain[2]["content"] == (
        "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"
    )
    aware = template_messages(messages, knows_tools=True)
    assert aware[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert aware[2]["tool_call_id"] == "call_1"


# -- prompts with tools ----------------------------------------------------------------


def test_a_template_that_knows_tools_renders_them(engine):
    """The tools go to the template's own `tools` (its tojson writes JSON,
    not HTML escapes); past calls reach it with parsed arguments."""
    reply = engine.client().generate(
        GenerateRequest(
            model=TOOLED,
            messages=[
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": '{"city": "Oslo"}',
                            },
                        }
                    ],
                },
                {"role": "tool", "content": "Rain", "tool_call_id": "c1"},
            ],
            tools=[WEATHER],
            max_tokens=1,
            echo=True,
        )
    )
    prompt = reply.prompt_text
    assert '"description": "Weather <now> & later"' in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "# Tools" not in prompt  # not our own instructions


def test_a_template_without_tools_gets_them_in_a_system_message(engine):
    reply = engine.client().generate(
        GenerateRequest(
            model=SMOL,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            max_tokens=1,
            echo=True,
        )
    )
    prompt = reply.prompt_text
    assert prompt.index("# Tools") < prompt.index("Weather?")
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    # tool_choice none: no tools offered at all.
    none = engine.client().generate(
        GenerateRequest(
            model=SMOL,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            tool_choice="none",
            max_tokens=1,
            echo=True,
        )
    )
    assert "# Tools" not in none.prompt_text


def test_a_named_tool_is_called_with_valid_arguments(engine):
    reply = engine.client().generate(
        GenerateRequest(
            model=SMOL,
            messages=[{"role": "user", "content": "What is the weather in Rome?"}],
            tools=[WEATHER],
            tool_choice={"name": "get_weather"},
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
    )
    assert reply.finish_reason == "tool_calls"
    [call] = reply.tool_calls
    assert call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}


# -- refusals ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"bogus": 1}, "bogus: unknown field"),
        ({"prompt_tokens": [1, 2**30]}, "token ids are below"),
        ({"tools": [WEATHER], "tool_choice": {"name": "other"}}, "not among the tools"),
        ({"tool_choice": "required"}, "no tools are offered"),
        ({"tools": [WEATHER, WEATHER]}, "two share a name"),
        ({"response_format": {"type": "json_schema"}}, "needs a schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"if": {"type": "object"}, "then": {}},
                }
            },
            "Unimplemented keys",
        ),
        (
            {"response_format": {"type": "json_object"}, "tools": [WEATHER]},
            "not both",
        ),
    ],
)
def test_bad_constraints_are_refused(engine, fields, says):
    """Each bad constraint is `bad_request` from the engine, saying what is
    wrong (sent as it is: no client checks it on the way)."""
    base = (
        {}
        if "prompt_tokens" in fields
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    message = {"kind": "generate", "model": SMOL, "max_tokens": 4, **base, **fields}
    reply = raw_exchange(
        engine.port, auth_frame(engine.token) + encode_message(message)
    )
    assert reply["code"] == "bad_request"
    assert says in reply["message"]


def test_tools_over_their_total_cap_are_refused_before_rendering(engine):
    """128 tools, each within its caps, ~2 MiB together: refused by the
    engine's typed request before any prompt is rendered; the same request
    with tools under the cap is answered (the control)."""
    big = [
        {**WEATHER, "name": f"tool_{i}", "description": "d" * 16_000}
        for i in range(128)
    ]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(EngineRequestError) as refused:
        engine.client().generate(GenerateRequest(model=SMOL, tools=big, **chat))
    assert refused.value.code == "bad_request"
    assert f"over the cap of {MAX_TOOLS_CHARS}" in refused.value.message
    small = [{**tool, "description": "d"} for tool in big[:2]]
    request = GenerateRequest(model=SMOL, tools=small, **chat)
    assert engine.client().generate(request).finish_reason


# -- constrained slots in the batch ---------------------------------------------

BATCHED = """
import json
from engines.backends.gguf import LlamaBackend
from engines.wire.requests import parse_request
from engines.generation.runner import GenerationRequest
from engines.generation.sampling import SamplingParams

backend = LlamaBackend(MODEL, n_slots=4, context_length=512, n_threads=2)
SCHEMA = {"type": "object", "properties": {"items": {"type": "array",
          "maxItems": 5, "items": {"type": "integer"}}}, "required": ["items"]}


def admit(text, schema):
    message = {"kind": "generate", "model": "m",
               "messages": [{"role": "user", "content": text}]}
    if schema:
        message["response_format"] = {"type": "json_schema", "json_schema": schema}
    typed = parse_request(message)
    matcher = backend.grammars.matcher_for(typed)
    events = []
    request = GenerationRequest(
        backend.tokenize(backend.render_prompt(message)),
        SamplingParams(temperature=0.0, max_tokens=40),
        events.append,
        matcher=matcher,
    )
    backend.admit(request)
    return next(s for s in backend.slots if s.request is request), events


slots = [admit("Tell me a story.", None), admit("Name some numbers.", SCHEMA),
         admit("Describe the sea.", None), admit("Count to ten.", SCHEMA)]
while any(s.todo for s, _ in slots):
    backend.step()
passes = []
while backend.active():
    before = [s.generated if s.request else None for s, _ in slots]
    backend.step()
    passes.append([
        (s.generated if s.request else None, b) for (s, _), b in zip(slots, before)
    ])
answers = ["".join(e.get("text", "") for e in events if e["event"] == "token")
           for _, events in slots]
print(json.dumps({"passes": passes[:10], "answers": answers,
                  "compiled": len(backend.grammars._compiled)}))
"""


def test_constrained_and_free_slots_share_every_pass(models_dir):
    """Two constrained and two free requests in one batch: while all four
    run, each pass gives every one of them a token; the constrained answers
    match their schema (compiled once for both)."""
    model = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = run_python(f"MODEL = {str(model)!r}\n{BATCHED}", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    full = [p for p in report["passes"] if all(b is not None for _, b in p)]
    assert len(full) >= 5, report
    for one_pass in full:
        for after, before in one_pass:
            # One more token, or the request ended in this pass.
            assert after is None or after == before + 1, report
    for index in (1, 3):
        parsed = json.loads(report["answers"][index])
        assert all(isinstance(item, int) for item in parsed["items"])
    for index in (0, 2):  # the control: free text, not that JSON
        with pytest.raises(ValueError):
            json.loads(report["answers"][index])
    assert report["compiled"] == 1


# -- grammar limits and the mask budget ------------------------------------------

LIMITS = """
import json
from engines.backends.gguf import LlamaBackend
from engines.constrained.grammar import GRAMMAR_LIMITS, MASK_BUDGET_S
from engines.wire.requests import parse_request
from engines.generation.runner import GenerationRequest
from engines.wire.framing import ProtocolError
from engines.generation.sampling import SamplingParams

backend = LlamaBackend(MODEL, n_slots=2, context_length=512, n_threads=2)
grammars = backend.grammars
report = {}

WIDE = {"type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
wide = parse_request({"kind": "generate", "model": "m", "prompt": "x",
    "response_format": {"type": "json_schema", "json_schema": WIDE}})
grammars.limits = {**GRAMMAR_LIMITS, "max_grammar_size": 1000}
try:
    grammars.matcher_for(wide)
except ProtocolError as error:
    report["refused"] = [error.code, error.message]
grammars.limits = dict(GRAMMAR_LIMITS)
report["wide_compiles"] = grammars.matcher_for(wide) is not None

# The densest tools near the cap (128 tools of 60 integer arguments) compile
# under the engine's own limits.
tools = [{"name": f"tool_{i}", "parameters": {"type": "object",
          "properties": {f"a{j}": {"type": "integer"} for j in range(60)}}}
         for i in range(128)]
dense = parse_request({"kind": "generate", "model": "m",
    "messages": [{"role": "user", "content": "hi"}], "tools": tools,
    "tool_choice": "required"})
report["dense_tools_compile"] = not grammars.matcher_for(dense).is_error()

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}},
          "required": ["n"]}


def admit(text, schema):
    message = {"kind": "generate", "model": "m",
               "messages": [{"role": "user", "content": text}]}
    if schema:
        message["response_format"] = {"type": "json_schema", "json_schema": schema}
    typed = parse_request(message)
    events = []
    request = GenerationRequest(
        backend.tokenize(backend.render_prompt(message)),
        SamplingParams(temperature=0.0, max_tokens=20),
        events.append,
        matcher=grammars.matcher_for(typed),
    )
    backend.admit(request)
    return events


def run(budget):
    grammars.mask_budget_s = budget
    constrained, free = admit("Pick a number.", SCHEMA), admit("Say hello.", None)
    while backend.active():
        backend.step()
    return {"constrained": constrained[-1], "free": free[-1],
            "text": "".join(e.get("text", "") for e in constrained)}


report["tiny"] = run(1e-9)
report["normal"] = run(MASK_BUDGET_S)
print(json.dumps(report))
"""


def test_grammar_limits_and_the_mask_budget(models_dir):
    """A grammar past llguidance's limits is refused with the library's
    reason; the engine's own limits take the densest tools the caps allow.
    A constrained request whose mask exceeds its budget fails alone
    (bad_request, saying so) while a free request in the same batch
    completes; with the normal budget the same request succeeds (the
    control)."""
    model = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = run_python(f"MODEL = {str(model)!r}\n{LIMITS}", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    code, message = report["refused"]
    assert code == "bad_request"
    assert "grammar size (number of symbols) too big" in message
    assert report["wide_compiles"] and report["dense_tools_compile"]
    tiny, normal = report["tiny"], report["normal"]
    assert tiny["constrained"]["event"] == "error", report
    assert tiny["constrained"]["code"] == "bad_request"
    assert "next-token mask" in tiny["constrained"]["message"]
    assert tiny["free"]["event"] == "done"
    assert normal["constrained"]["event"] == "done", report
    assert isinstance(json.loads(normal["text"])["n"], int)
    assert normal["free"]["event"] == "done"
