"""A generation backend that counts instead of decoding, for the decode thread's
tests and the watch's: it can be told to raise or to block."""

import threading

from engines.generation.runner import GenerationBackend, GenerationRequest


class CountingBackend(GenerationBackend):
    """Each step emits one token per running request until its max_tokens.
    `raise_on_admit` / `raise_on_step` make the next admission or step raise;
    `block` makes steps wait until it is set."""

    def __init__(self, n_slots: int = 4) -> None:
        self.n_slots = n_slots
        self.running: dict[str, tuple[GenerationRequest, int]] = {}
        self.raise_on_admit: BaseException | None = None
        self.raise_on_step: BaseException | None = None
        self.block = threading.Event()
        self.block.set()
        self.closed = False

    def render_prompt(self, message):
        return message["prompt"]

    def tokenize(self, text):
        return list(range(len(text)))

    def free_slots(self):
        return self.n_slots - len(self.running)

    def active(self):
        return len(self.running)

    def admit(self, request):
        if self.raise_on_admit is not None:
            error, self.raise_on_admit = self.raise_on_admit, None
            raise error
        self.running[request.id] = (request, 0)

    def step(self):
        self.block.wait()
        if self.raise_on_step is not None:
            error, self.raise_on_step = self.raise_on_step, None
            raise error
        for request_id, (request, made) in list(self.running.items()):
            request.emit({"event": "token", "text": "x", "tokens": 1})
            if made + 1 >= request.params.max_tokens:
                del self.running[request_id]
                request.finish({"event": "done", "finish_reason": "length"})
            else:
                self.running[request_id] = (request, made + 1)

    def cancel(self, request_id):
        entry = self.running.pop(request_id, None)
        if entry:
            entry[0].finish({"event": "done", "finish_reason": "cancelled"})
        return entry is not None

    def running_ids(self):
        return set(self.running)

    def fail_running(self, code, message):
        for request, _ in self.running.values():
            request.finish({"event": "error", "code": code, "message": message})
        self.running.clear()

    def close(self):
        self.closed = True
