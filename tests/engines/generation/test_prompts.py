"""A request's prompt text (engines/generation/prompts.py) as a unit: a
completion prompt as sent, a chat through the model's own chat template (the
bundled SmolLM2's, read from its GGUF header), and the tools a request offers,
rendered by a template that knows tools or else described in a system message."""

from pathlib import Path

import pytest
from django.conf import settings

from engines.backends.ggufmeta import read_header
from engines.constrained.toolcalls import tools_instructions
from engines.generation.prompts import OfferedTools, offered_tools, render_prompt
from engines.wire.bounds import MAX_PROMPT_CHARS
from engines.wire.errors import ProtocolError
from engines.wire.requests import Function

# What SmolLM2 adds to a chat that brings no system message of its own.
SMOL_SYSTEM = (
    "<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
# A template that renders `tools` itself, as tool-calling models' templates do
# (none of the bundled models has one).
TOOLS_TEMPLATE = (
    "{% for tool in tools or [] %}tool {{ tool.function.name }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOL = {"name": "ferry_times", "description": "When the ferries leave"}


@pytest.fixture(scope="module")
def smol_template() -> str:
    path = Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return read_header(path).get("tokenizer.chat_template")


def chat(*turns: tuple[str, str], **extra) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


def render(message: dict, template: str, **kwargs) -> str:
    return render_prompt(message, template=template, bos_text="", eos_text="", **kwargs)


def test_a_completion_prompt_is_the_text_as_sent(smol_template):
    """A `prompt` is the prompt, whatever the chat template."""
    assert render({"prompt": "Once upon a time"}, smol_template) == "Once upon a time"


@pytest.mark.parametrize("message", [{}, {"prompt": ""}, {"prompt": 3}])
def test_a_request_without_a_prompt_is_a_bad_request(smol_template, message):
    """No prompt, an empty one or one that is not a string: bad_request."""
    with pytest.raises(ProtocolError) as error:
        render(message, smol_template)
    assert error.value.code == "bad_request"
    assert "send `prompt`" in error.value.message


def test_a_prompt_over_the_cap_is_refused(smol_template):
    """One character over the cap is refused; at the cap it is the prompt (the
    control)."""
    at_cap = "x" * MAX_PROMPT_CHARS
    assert render({"prompt": at_cap}, smol_template) == at_cap
    with pytest.raises(ProtocolError) as error:
        render({"prompt": at_cap + "x"}, smol_template)
    assert error.value.code == "bad_request"
    assert "exceeds the cap" in error.value.message


def test_a_chat_goes_through_the_models_template(smol_template):
    """SmolLM2's template: its own system prompt when the chat brings none,
    each turn in its markers, and the opening of the answer."""
    prompt = render(chat(("user", "Hi")), smol_template)
    assert prompt == (
        f"{SMOL_SYSTEM}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_chat_for_a_model_without_a_template_is_refused():
    """A chat needs the model's chat template: bad_request without one."""
    with pytest.raises(ProtocolError) as error:
        render(chat(("user", "Hi")), "")
    assert error.value.code == "bad_request"
    assert "no chat template" in error.value.message


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty list"),
        ("Hi", "non-empty list"),
        (["Hi"], "must be an object"),
        ([{"role": "user"}], "string role and content"),
    ],
)
def test_malformed_messages_are_bad_requests(smol_template, messages, needle):
    """Messages that are not a list of role and content: bad_request, naming
    what is wrong."""
    with pytest.raises(ProtocolError) as error:
        render({"messages": messages}, smol_template)
    assert error.value.code == "bad_request"
    assert needle in error.value.message


def test_tools_become_a_system_message_where_the_template_cannot_render_them(
    smol_template,
):
    """SmolLM2's template knows no tools: they are described in a system
    message of their own, which takes the place of the model's default one."""
    prompt = render(chat(("user", "When?"), tools=[TOOL]), smol_template)
    text = tools_instructions([Function(**TOOL)], parallel=True)
    assert prompt.startswith(f"<|im_start|>system\n{text}<|im_end|>\n")
    assert "named SmolLM" not in prompt
    assert prompt.endswith("<|im_start|>user\nWhen?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_join_the_chats_own_system_message(smol_template):
    """A chat with a system message keeps it first, the tools' description
    after a blank line, in the same message."""
    message = chat(("system", "Be brief."), ("user", "When?"), tools=[TOOL])
    prompt = render(message, smol_template)
    text = tools_instructions([Function(**TOOL)], parallel=True)
    assert prompt.startswith(f"<|im_start|>system\nBe brief.\n\n{text}<|im_end|>\n")
    assert prompt.count("<|im_start|>system") == 1


def test_tool_choice_none_offers_no_tools(smol_template):
    """With tool_choice none the prompt is the chat's alone; the control: the
    same chat offering its tools is another prompt."""
    plain = render(chat(("user", "When?")), smol_template)
    offering = chat(("user", "When?"), tools=[TOOL])
    assert render({**offering, "tool_choice": "none"}, smol_template) == plain
    assert render(offering, smol_template) != plain


def test_a_template_that_knows_tools_renders_them_itself():
    """The tools go to the template as OpenAI-shaped schemas; no system text."""
    prompt = render(chat(("user", "When?"), tools=[TOOL]), TOOLS_TEMPLATE)
    assert prompt == "tool ferry_times\nuser: When?\nassistant:"


def test_offered_tools_follow_the_template_and_parallel_calls(smol_template):
    """Schemas for a template that knows tools; otherwise the description,
    which says whether several calls may be made at once."""
    known = offered_tools({"tools": [TOOL]}, template=TOOLS_TEMPLATE)
    assert known.instructions == ""
    assert known.schemas == [
        {
            "type": "function",
            "function": {
                "name": "ferry_times",
                "parameters": {"type": "object", "properties": {}},
                "description": "When the ferries leave",
            },
        }
    ]
    several = offered_tools({"tools": [TOOL]}, template=smol_template)
    assert several.schemas == [] and "one or more functions" in several.instructions
    one = offered_tools(
        {"tools": [TOOL], "parallel_tool_calls": False}, template=smol_template
    )
    assert "You may call one function" in one.instructions
    assert offered_tools({}, template=smol_template) == OfferedTools([])


def test_tools_made_once_are_rendered_as_given(smol_template):
    """A request's tools, made into prompt text once (a chat whose oldest turns
    are dropped is rendered several times), are used as given, not made again."""
    made = OfferedTools([], "# Tools made earlier")
    prompt = render(chat(("user", "When?"), tools=[TOOL]), smol_template, tools=made)
    assert prompt.startswith("<|im_start|>system\n# Tools made earlier<|im_end|>\n")
