"""A prompt against the model's context (engines/generation/context.py) as a
unit, on the tiny Llama the tests build (a real tokenizer and chat template,
loaded in-process): what fits is its tokens; what does not is refused with
the counts, or, where the model allows it, fitted by dropping the oldest
turns of the chat. (The same through a real engine: test_context.py.)"""

import pytest

from engines.backends.hf import TransformersBackend
from engines.generation.context import DROP_OLDEST, REFUSE, fit_prompt
from engines.generation.sampling import SamplingParams
from engines.wire.errors import ProtocolError

CONTEXT = 128
SYSTEM = {"role": "system", "content": "You answer questions about the harbour."}
LATEST = {"role": "user", "content": "And the last ferry?"}


@pytest.fixture(scope="module")
def backend(tiny_llama):
    return TransformersBackend(tiny_llama, n_slots=1, context_length=CONTEXT)


def answer(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def room(max_tokens: int) -> int:
    """What drop_oldest leaves for the answer: max_tokens, at most a quarter."""
    return min(max_tokens, CONTEXT // 4)


def history(turns: int) -> list[dict]:
    """`turns` question and answer pairs, oldest first."""
    messages = []
    for n in range(turns):
        messages.append({"role": "user", "content": f"When does ferry {n} leave?"})
        messages.append({"role": "assistant", "content": f"At {n + 1} o'clock."})
    return messages


def count(backend, messages: list[dict]) -> int:
    """The token count of a chat rendered whole."""
    return len(backend.tokenize(backend.render_prompt({"messages": messages})))


def test_a_prompt_that_fits_is_its_tokens(backend):
    """A prompt that fits is the model's tokens of it, nothing dropped."""
    prompt = fit_prompt(backend, {"prompt": "the cat sat"}, answer())
    assert prompt.tokens == backend.tokenize("the cat sat")
    assert prompt.dropped_messages == 0


def test_prompt_tokens_are_taken_as_sent_below_the_vocabulary(backend):
    """Token ids are the prompt as they are; an id the model does not know is
    a bad request naming its vocabulary (the last one it knows is fine)."""
    vocabulary = backend.vocabulary_size()
    last = [1, 2, vocabulary - 1]
    assert fit_prompt(backend, {"prompt_tokens": last}, answer()).tokens == last
    with pytest.raises(ProtocolError) as error:
        fit_prompt(backend, {"prompt_tokens": [1, vocabulary]}, answer())
    assert error.value.code == "bad_request"
    assert f"below {vocabulary}" in error.value.message


@pytest.mark.parametrize("policy", [REFUSE, DROP_OLDEST])
def test_one_token_of_answer_must_fit(backend, policy):
    """A prompt two tokens short of the context fits; one token short is
    refused with the counts and the model's name, whatever the policy (a
    completion prompt has no turns to drop)."""
    fits = {"prompt_tokens": [5] * (CONTEXT - 2)}
    assert len(fit_prompt(backend, fits, answer(1), policy=policy).tokens) == 126
    with pytest.raises(ProtocolError) as error:
        fit_prompt(
            backend,
            {"prompt_tokens": [5] * (CONTEXT - 1)},
            answer(1),
            policy=policy,
            model="tiny",
        )
    assert error.value.code == "context_length_exceeded"
    assert "this prompt has 127 tokens; tiny's context holds 128" in (
        error.value.message
    )


def test_refuse_turns_a_long_chat_away_with_the_counts(backend):
    """With refuse (the default) a chat over the context is refused with its
    token count, pointing at drop_oldest."""
    messages = [SYSTEM, *history(8), LATEST]
    assert count(backend, messages) > CONTEXT  # the premise
    with pytest.raises(ProtocolError) as error:
        fit_prompt(backend, {"messages": messages}, answer())
    assert error.value.code == "context_length_exceeded"
    assert f"this prompt has {count(backend, messages)} tokens" in error.value.message
    assert "drop the oldest turns" in error.value.message


def test_drop_oldest_drops_the_fewest_whole_turns_that_leave_room(backend):
    """The system message and the latest question stay; the oldest turns go,
    whole (the kept part starts at a question), as few as leave room for the
    answer: one turn fewer dropped would not."""
    messages = [SYSTEM, *history(8), LATEST]
    prompt = fit_prompt(backend, {"messages": messages}, answer(), policy=DROP_OLDEST)
    dropped = prompt.dropped_messages
    assert dropped > 0 and dropped % 2 == 0
    kept = [SYSTEM, *messages[1 + dropped :]]
    assert kept[1]["role"] == "user" and kept[-1] == LATEST
    assert prompt.tokens == backend.tokenize(backend.render_prompt({"messages": kept}))
    assert len(prompt.tokens) + room(16) <= CONTEXT
    fuller = [SYSTEM, *messages[1 + dropped - 2 :]]
    assert count(backend, fuller) + room(16) > CONTEXT


def test_drop_oldest_leaves_room_for_the_answer_that_refuse_does_not(backend):
    """A chat that fits with less room than the answer asks: refuse serves it
    whole (the answer may end at the context); drop_oldest drops turns until
    the room is there."""
    messages = [SYSTEM, *history(1), LATEST]
    whole = count(backend, messages)
    max_tokens = CONTEXT - whole + 8  # more than is left, within a quarter
    assert whole < CONTEXT - 1 and whole + room(max_tokens) > CONTEXT  # premise
    refused = fit_prompt(backend, {"messages": messages}, answer(max_tokens))
    assert refused.dropped_messages == 0 and len(refused.tokens) == whole
    dropped = fit_prompt(
        backend, {"messages": messages}, answer(max_tokens), policy=DROP_OLDEST
    )
    assert dropped.dropped_messages > 0
    assert len(dropped.tokens) + room(max_tokens) <= CONTEXT


def test_a_chat_with_no_turn_to_drop_is_refused(backend):
    """Leading system messages are never dropped, nor the latest message: a
    long system prompt with one question cannot be fitted."""
    system = {"role": "system", "content": "Rules: be kind. " * 40}
    messages = [system, LATEST]
    assert count(backend, messages) > CONTEXT  # the premise
    with pytest.raises(ProtocolError) as error:
        fit_prompt(backend, {"messages": messages}, answer(), policy=DROP_OLDEST)
    assert error.value.code == "context_length_exceeded"
    assert "no turn to drop" in error.value.message


def test_what_does_not_fit_with_every_turn_dropped_is_refused(backend):
    """Every turn dropped and still too long: refused, saying how many went."""
    system = {"role": "system", "content": "Rules: be kind. " * 40}
    messages = [system, *history(2), LATEST]
    with pytest.raises(ProtocolError) as error:
        fit_prompt(backend, {"messages": messages}, answer(), policy=DROP_OLDEST)
    assert error.value.code == "context_length_exceeded"
    assert "its 4 oldest messages dropped" in error.value.message
