"""The typed replies of an engine (engines/wire/replies.py): each kind reads
back as it was sent; a reply with a key its schema does not know, or without
one it needs, is refused (each with its control); and the client turns a
mismatched reply into an error, not a partial read."""

import json

import pytest
from pydantic import ValidationError

from engines.wire.client import EngineReplyInvalid, _reply
from engines.wire.errors import ErrorCode
from engines.wire.framing import decode_message
from engines.wire.replies import (
    CalledTool,
    CancelReply,
    DoneFrame,
    EmbedReply,
    EmbedUsage,
    ErrorReply,
    GenerateAnswer,
    LoadReply,
    Logprob,
    ModelState,
    OkReply,
    PingReply,
    StartFrame,
    StateReply,
    Temperature,
    Timings,
    TokenFrame,
    ToolCallDelta,
    TopLogprob,
    UnloadReply,
    Usage,
    parse_reply,
)
from tests.engines.wire.frames import split_frames

MODEL = ModelState(
    name="smol",
    format="gguf",
    memory_mib=120.5,
    device_memory_mib=0.0,
    loaded_at=1700000000.0,
    idle_s=0.4,
    inflight=1,
    queued=0,
    busy=1,
    slots=4,
    steps=12,
    slots_auto=True,
    context=2048,
    kv_pool_tokens=8192,
    kv_mib=48.0,
    kv_groups=1,
    copied_tokens=0,
)
LOGPROB = Logprob(
    token="Hi",
    logprob=-0.25,
    bytes=[72, 105],
    top_logprobs=[TopLogprob(token="Hi", logprob=-0.25, bytes=[72, 105])],
)
USAGE = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=2)
TIMINGS = Timings(first_token_ms=12.5, total_ms=40.0)

# Every reply an engine sends, by the request kind it answers.
REPLIES = [
    ("ping", PingReply(engine="cpu0", pid=42, phase="ready")),
    (
        "state",
        StateReply(
            engine="cpu0",
            pid=42,
            port=9000,
            phase="loading",
            healthy=True,
            unhealthy_reason="",
            started_at=1700000000.0,
            models=[MODEL],
            loading=["other"],
            unloading=[],
            queue_depth=2,
            slots_in_use=1,
            cooling_reason="",
            rss_mib=512.0,
            temperatures=[Temperature(device="cpu", celsius=55.0)],
            tokens_generated=99,
            limits={"max_parallel_requests": 8, "queue_timeout_s": 30.0},
        ),
    ),
    ("load", LoadReply(model=MODEL)),
    ("unload", UnloadReply(drained=True)),
    (
        "embed",
        EmbedReply(
            model="minilm",
            shape=[1, 2],
            dtype="float32",
            usage=EmbedUsage(prompt_tokens=3),
            encoding="json",
            embeddings=[[0.5, -1.0]],
        ),
    ),
    (
        "generate",
        GenerateAnswer(
            request_id="r1",
            finish_reason="tool_calls",
            usage=USAGE,
            tool_calls=[CalledTool(id="call_1", name="f", arguments="{}")],
            dropped_messages=1,
            timings=TIMINGS,
            text="Hi",
            logprobs=[LOGPROB],
            prompt_text="Say hi",
        ),
    ),
    (
        "generate_stream",
        StartFrame(request_id="r1", prompt_tokens=7, dropped_messages=0),
    ),
    (
        "generate_stream",
        TokenFrame(
            text="Hi",
            tokens=1,
            logprobs=[LOGPROB],
            tool_calls=[ToolCallDelta(index=0, id="call_1", name="f")],
        ),
    ),
    (
        "generate_stream",
        DoneFrame(request_id="r1", finish_reason="stop", usage=USAGE, timings=TIMINGS),
    ),
    ("generate_stream", ErrorReply(code=ErrorCode.OVERLOADED, message="full")),
    ("cancel", CancelReply(cancelled=False)),
    ("configure", OkReply()),
    ("shutdown", OkReply()),
    ("state", ErrorReply(code=ErrorCode.INTERNAL, message="internal error")),
]
IDS = [f"{kind}-{type(reply).__name__}" for kind, reply in REPLIES]


def sent(reply) -> dict:
    """The JSON object a reply travels as (one whole frame)."""
    [payload] = list(split_frames(reply.encoded()))
    return decode_message(payload)


@pytest.mark.parametrize(("kind", "reply"), REPLIES, ids=IDS)
def test_each_reply_reads_back_as_sent(kind, reply):
    """A reply, encoded as the engine sends it, parses back equal, as the
    same kind of reply."""
    [payload] = list(split_frames(reply.encoded()))
    parsed = parse_reply(kind, payload)
    assert type(parsed) is type(reply)
    assert parsed == reply


def test_none_is_left_out_and_reads_back_as_none():
    """Fields that are None do not travel; they read back as None."""
    start = StartFrame(request_id="r1", prompt_tokens=3)
    assert "prompt_text" not in sent(start)
    assert parse_reply("generate_stream", sent(start)).prompt_text is None
    cancelled = DoneFrame(
        request_id="r1",
        finish_reason="cancelled",
        usage=Usage(prompt_tokens=3, completion_tokens=0),
        timings=Timings(total_ms=1.0),
    )
    assert sent(cancelled)["timings"] == {"total_ms": 1.0}
    assert parse_reply("generate_stream", sent(cancelled)) == cancelled


@pytest.mark.parametrize(("kind", "reply"), REPLIES, ids=IDS)
def test_an_unknown_key_is_refused(kind, reply):
    """A key the reply's schema does not know is refused, not dropped; the
    same reply without it is read (the control)."""
    message = sent(reply)
    assert parse_reply(kind, message) == reply
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        parse_reply(kind, {**message, "surprise": 1})


@pytest.mark.parametrize(("kind", "reply"), REPLIES, ids=IDS)
def test_a_missing_required_key_is_refused(kind, reply):
    """A reply without a key it needs is refused, not defaulted; with it, it
    is read (the control)."""
    message = sent(reply)
    assert parse_reply(kind, message) == reply
    required = [
        name for name, field in type(reply).model_fields.items() if field.is_required()
    ]
    if not required:  # an `ok` without more: its status is what it needs
        required = ["status"]
    for name in required:
        partial = {key: value for key, value in message.items() if key != name}
        with pytest.raises(ValidationError):
            parse_reply(kind, partial)


def test_nested_parts_refuse_unknown_keys_too():
    """A model of a state reply with a key nobody knows is refused; the
    control reads."""
    message = sent(REPLIES[1][1])
    assert parse_reply("state", message).models == [MODEL]
    message["models"][0]["surprise"] = True
    with pytest.raises(ValidationError, match="models.0"):
        parse_reply("state", message)


def test_a_stream_frame_is_told_by_its_event():
    """A stream's frames are told apart by `event` (and an error by its
    `status`): a token is never read as a done, an unknown event is refused."""
    token = sent(TokenFrame(text="a", tokens=1))
    assert isinstance(parse_reply("generate_stream", token), TokenFrame)
    with pytest.raises(ValidationError):
        parse_reply("generate_stream", {**token, "event": "done"})
    with pytest.raises(ValidationError):
        parse_reply("generate_stream", {**token, "event": "progress"})


def test_an_error_code_outside_the_enum_is_refused():
    """Error codes are ErrorCode's; any other is a mismatch (the control: a
    known code reads)."""
    known = {"status": "error", "code": "overloaded", "message": "full"}
    assert parse_reply("ping", known).code is ErrorCode.OVERLOADED
    with pytest.raises(ValidationError):
        parse_reply("ping", {**known, "code": "on_fire"})


def test_the_client_turns_a_mismatch_into_an_error():
    """The client raises EngineReplyInvalid (an internal error) for a reply
    its schema refuses, naming the key; a good reply is returned (the
    control)."""
    good = sent(PingReply(engine="cpu0", pid=1, phase="ready"))
    assert _reply("ping", json.dumps(good).encode(), "cpu0").pid == 1
    with pytest.raises(EngineReplyInvalid) as refused:
        _reply("ping", json.dumps({**good, "uptime": 3}).encode(), "cpu0")
    assert refused.value.code is ErrorCode.INTERNAL
    assert "uptime" in refused.value.message
