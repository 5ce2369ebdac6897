"""Serving one generation on a connection (engines/runtime/streaming.py) as a
unit, in this process: the tiny Llama the tests build, its runner on a decode
thread of its own, and a real socket pair for the connection (the engine's
end given to serve_generation, the caller's end read by the test)."""

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from engines.backends.hf import TransformersBackend
from engines.generation.runner import DecodeThread, GenerationRunner
from engines.launch.config import ModelSpec
from engines.runtime.residency import ResidentModel
from engines.runtime.streaming import serve_generation
from engines.wire.errors import ProtocolError
from engines.wire.framing import decode_message, encode_message, read_frame
from engines.wire.replies import GenerateAnswer, parse_reply
from engines.wire.requests import parse_request
from tests.waiting import await_for, wait_for

PROMPT = "the cat sat on the mat"


@pytest.fixture
def decoder() -> DecodeThread:
    return DecodeThread(max_parallel=4)


@pytest.fixture
async def model(tiny_llama, decoder):
    """The tiny Llama, resident with one slot and its own decode thread."""
    spec = ModelSpec(name="tiny", format="transformers", path=str(tiny_llama))
    backend = TransformersBackend(tiny_llama, n_slots=1, context_length=512)
    runner = GenerationRunner(
        backend,
        name="tiny",
        queue_limit=4,
        queue_timeout_s=30,
        decoder=decoder,
    )
    executor = ThreadPoolExecutor(1)
    yield ResidentModel(spec, backend, executor, memory_mib=0.0, runner=runner)
    await asyncio.to_thread(runner.close, 30)
    executor.shutdown()


class Call:
    """One generation request served on a socket pair: `frames()` reads what
    the caller receives; `hang_up()` closes the caller's end."""

    def __init__(self, model: ResidentModel, generations: dict, **fields) -> None:
        self.message = {"model": "tiny", "kind": "generate_stream", **fields}
        self.counted: list[int] = []
        self._model, self._generations = model, generations

    async def start(self) -> "Call":
        engine_end, caller_end = socket.socketpair()
        reader, self._writer = await asyncio.open_connection(sock=engine_end)
        self._reader, self._caller = await asyncio.open_connection(sock=caller_end)
        self.task = asyncio.create_task(self._serve(reader))
        return self

    async def _serve(self, reader: asyncio.StreamReader) -> None:
        try:
            await serve(
                self._model,
                self.message,
                reader,
                self._writer,
                generations=self._generations,
                count_tokens=self.counted.append,
            )
        finally:
            self._writer.close()

    async def frame(self) -> dict | None:
        """The next frame the caller receives (None: the engine closed)."""
        payload = await asyncio.wait_for(read_frame(self._reader), 60)
        return None if payload is None else decode_message(payload)

    async def frames(self) -> list[dict]:
        """Every frame up to the connection's end."""
        frames = []
        while (frame := await self.frame()) is not None:
            frames.append(frame)
        await self.task
        return frames

    def hang_up(self) -> None:
        self._caller.close()


async def serve(model, message, reader, writer, **kwargs) -> None:
    """serve_generation, as the server calls it for one request."""
    request = parse_request(message, size=len(encode_message(message)))
    await serve_generation(model, request, reader, writer, received=0.0, **kwargs)


async def call(model, generations=None, **fields) -> Call:
    return await Call(
        model, {} if generations is None else generations, **fields
    ).start()


GREEDY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


async def test_a_stream_is_a_start_its_tokens_and_a_final_frame(model):
    """Once a slot takes it: a start frame with the prompt's token count, one
    frame per text chunk, then the final frame with the finish reason and
    usage; every token is counted for the engine's total."""
    frames = await (await call(model, **GREEDY)).frames()
    start, tokens, done = frames[0], frames[1:-1], frames[-1]
    assert start["event"] == "start"
    assert start["prompt_tokens"] == len(model.runner.backend.tokenize(PROMPT))
    assert tokens and all(frame["event"] == "token" for frame in tokens)
    assert done["event"] == "done" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 6
    assert done["request_id"] == start["request_id"]
    assert set(done["timings"]) == {"first_token_ms", "total_ms"}


async def test_a_whole_answer_is_one_frame_of_the_streams_text(model):
    """`generate` (not a stream) gets one frame: the text a greedy stream of
    the same request sends in pieces, and the same count of tokens."""
    streamed = await call(model, **GREEDY)
    pieces = [f["text"] for f in await streamed.frames() if f["event"] == "token"]
    whole = await call(model, **{**GREEDY, "kind": "generate"})
    (answer,) = await whole.frames()
    assert isinstance(parse_reply("generate", answer), GenerateAnswer)
    assert answer["text"] == "".join(pieces) != ""
    assert sum(whole.counted) == sum(streamed.counted) == 6


async def test_a_caller_that_hangs_up_is_cancelled(model, decoder):
    """Once the caller closes its end mid-stream, the request is cancelled:
    serving ends, the request leaves the table `cancel` reads, and its slot is
    freed long before its 400 tokens. The control: the same request, kept,
    runs to its 400 tokens."""
    generations: dict = {}
    long = {**GREEDY, "max_tokens": 400, "request_id": "long"}
    streaming = await call(model, generations, **long)
    assert (await streaming.frame())["event"] == "start"
    assert (await streaming.frame())["event"] == "token"
    assert generations == {"long": model.runner}
    decoder.allowed.clear()  # as when cooling: no step starts, cancels are handled
    streaming.hang_up()
    await asyncio.wait_for(streaming.task, 60)
    assert generations == {}
    wait_for(lambda: model.runner.backend.active() == 0, what="the slot freed")
    assert model.runner.steps < 400  # cut short: one step is one token
    decoder.allowed.set()
    kept = await call(model, **long)
    assert (await kept.frames())[-1]["usage"]["completion_tokens"] == 400


async def test_a_request_refused_in_the_queue_gets_its_error_before_any_start(
    model, decoder
):
    """The front answers a stream's HTTP status at its start frame: a request
    that never gets a slot (its queue timeout passes while another holds the
    only one) gets the error frame first, and no start frame."""
    holding = await call(model, **{**GREEDY, "max_tokens": 400})
    assert (await holding.frame())["event"] == "start"
    decoder.allowed.clear()  # as when cooling: the holder keeps its slot
    refused = await call(model, **GREEDY)
    await await_for(lambda: model.runner.queued == 1, what="the request queued")
    model.runner.queue_timeout_s = 1e-9  # overdue at the next admission
    decoder.allowed.set()
    frames = await refused.frames()
    assert [frame["status"] for frame in frames] == ["error"]
    assert frames[0]["code"] == "overloaded"
    holding.hang_up()
    await holding.task


async def test_a_request_id_in_use_is_refused(model):
    """A request id already in the table is a bad request: nothing queued."""
    with pytest.raises(ProtocolError) as error:
        await serve(
            model,
            {**GREEDY, "model": "tiny", "kind": "generate", "request_id": "taken"},
            None,
            None,
            generations={"taken": model.runner},
        )
    assert error.value.code == "bad_request"
    assert model.runner.queued == 0


async def test_a_model_that_does_not_generate_is_refused(model):
    """An embedding model (no runner) cannot serve a generate request."""
    spec = ModelSpec(name="embedder", format="embedding", path="unused")
    embedder = ResidentModel(spec, backend=None, executor=None, memory_mib=0.0)
    with pytest.raises(ProtocolError) as error:
        await serve(
            embedder,
            {**GREEDY, "model": "embedder", "kind": "generate"},
            None,
            None,
            generations={},
        )
    assert error.value.code == "bad_request"
    assert "does not generate" in error.value.message


async def test_the_runner_is_in_the_table_only_while_the_request_runs(model):
    """`cancel` from another connection finds the runner by request id while
    the request runs, and it is gone once the final frame has left."""
    generations: dict = {}
    streaming = await call(model, generations, **GREEDY, request_id="r1")
    assert (await streaming.frame())["event"] == "start"
    assert generations == {"r1": model.runner}
    frames = await streaming.frames()
    assert frames[-1]["event"] == "done"
    assert generations == {}
