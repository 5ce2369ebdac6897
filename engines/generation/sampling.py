"""Backend-independent parts of text generation: sampling parameters, chat
templates, and the stream of text a slot hands back (UTF-8 reassembly and stop
strings). Pure Python: no ML library."""

import codecs
from dataclasses import dataclass, field
from typing import Any

from engines.wire.bounds import (
    check_sampling,
)
from engines.wire.errors import ProtocolError, bad_request


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; defaults come from the model's admin settings. The
    bounds live in `engines.wire.framing` (`check_sampling`), which the admin and the
    REST schemas use too."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of each generated token, and of the `top_logprobs` most
    # likely alternatives (0-20), computed from the raw logits.
    logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def from_request(
        cls, message: dict[str, Any], defaults: dict[str, Any] | None = None
    ) -> "SamplingParams":
        """Request fields over model defaults over ours, each checked. A field the
        request leaves out or sets to null takes the model's default."""
        defaults = defaults or {}
        set_here = {k: v for k, v in message.items() if v is not None}
        try:
            return cls(**check_sampling({**defaults, **set_here}))
        except ProtocolError as error:
            check_sampling(set_here)  # the request's own fault comes first
            # Otherwise it is a default the request did not override: say so.
            raise bad_request(
                f"the model's default sampling is invalid: {error.message}"
            ) from None


@dataclass
class TextStream:
    """Turns a slot's token bytes into text chunks safe to send.

    Bytes are decoded incrementally (a token may end inside a UTF-8 character),
    and text that could be the start of a stop string is held back until it is
    known not to be one. When a stop string appears, the text before it is the
    last chunk and the stream is finished (`stopped_by` names it).
    """

    stop: tuple[str, ...] = ()
    text: str = ""
    stopped: bool = False
    stopped_by: str | None = None
    _pending: str = ""
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )

    def decode_bytes(self, piece: bytes) -> str:
        """A token's bytes as text; a character split across tokens comes out
        whole with the token that completes it."""
        return self._decoder.decode(piece)

    def feed_text(self, text: str) -> str:
        """Add decoded text; return the text that may be sent now."""
        if self.stopped:
            return ""
        self._pending += text
        return self._release()

    def finish(self) -> str:
        """The held-back text, at the end of generation."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        out, self._pending = self._pending, ""
        self.text += out
        return out

    def _release(self) -> str:
        for stop in self.stop:
            at = self._pending.find(stop)
            if at >= 0:
                out = self._pending[:at]
                self._pending = ""
                self.stopped, self.stopped_by = True, stop
                self.text += out
                return out
        hold = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return out
