"""Backend-independent parts of text generation: sampling parameters, chat
templates, and the stream of text a slot hands back (UTF-8 reassembly and stop
strings). Pure Python: no ML library."""

import codecs
import json
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .protocol import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    ErrorCode,
    ProtocolError,
    check_sampling,
    check_text,
)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; defaults come from the model's admin settings. The
    bounds live in `engines.protocol` (`check_sampling`), which the admin and the
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
            raise _bad(
                f"the model's default sampling is invalid: {error.message}"
            ) from None


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Chat messages: a non-empty list of {"role": str, "content": str}; an
    assistant turn may carry `tool_calls` instead of content, a tool turn its
    `tool_call_id` (their shape is checked by engines.generate_request)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages")
    total = 0
    out = []
    for index, item in enumerate(messages):
        if not isinstance(item, dict):
            raise _bad("each message must be an object")
        role, content = item.get("role"), item.get("content")
        calls = item.get("tool_calls") or []
        if content is None and calls:
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise _bad("each message needs a string role and content")
        check_text(role, f"messages[{index}].role")
        check_text(content, f"messages[{index}].content")
        total += len(content)
        turn: dict[str, Any] = {"role": role, "content": content}
        if calls:
            turn["tool_calls"] = [
                call.model_dump() if hasattr(call, "model_dump") else call
                for call in calls
            ]
            for number, call in enumerate(turn["tool_calls"]):
                arguments = call["function"]["arguments"]
                check_text(arguments, f"messages[{index}].tool_calls[{number}]")
                total += len(arguments)
        for key in ("tool_call_id", "name"):
            if item.get(key):
                turn[key] = check_text(item[key], f"messages[{index}].{key}")
        out.append(turn)
    if total > MAX_PROMPT_CHARS:
        raise _bad(f"messages exceed the cap of {MAX_PROMPT_CHARS} characters")
    return out


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    """Chat templates' `tojson` as Hugging Face renders it (Jinja's own
    escapes <, > and & for HTML, which a prompt must not get)."""
    return json.dumps(
        value,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        ensure_ascii=ensure_ascii,
    )


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Apply a model's Jinja chat template (sandboxed) for a new assistant
    turn, with the tools offered where the template renders them."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as error:
        raise _bad(f"chat template failed: {error}") from None


@dataclass
class TextStream:
    """Turns a slot's token bytes into text chunks safe to send.

    Bytes are decoded incrementally (a token may end inside a UTF-8 character),
    and text that could be the start of a stop string is held back until it is
    known not to be one. When a stop string appears, the text before it is the
    last chunk and the stream is finished.
    """

    stop: tuple[str, ...] = ()
    text: str = ""
    stopped: bool = False
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
                self.stopped = True
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
