"""Prompt caching: a PrefixSharing object, which each slot backend
(engines/generation/slot_pool.py SlotBackend) holds and calls.

A slot keeps the KV of the tokens it last evaluated (`tokens`) when its
request ends. A new request goes to the free slot whose tokens share the
longest prefix with its prompt (ties: the least recently used), which keeps
that prefix, drops the rest, and evaluates only the new tokens (at least the
prompt's last, whose logits give the first token). The usage reports the
tokens taken from the cache (`cached_tokens`).

A prefix that a slot in use is still reading (a burst of new conversations
with one system prompt) is waited for instead of read twice: the new request
waits (`awaiting`) until the other slot has read it, then copies it. A prefix
is copied from a slot in the same KV group where one holds it, else from
another group where the backend can.

A request's cache salt (GenerateRequest.cache_salt: the front's id of whose
cache it may use) scopes all of it: a slot's cache, or a prefix a slot in
use holds, counts only for a request with the salt of the request that
filled it. Without that, one caller could tell from the answer's speed or its
`cached_tokens` whether another had sent a prompt starting the same way."""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engines.generation.slot import Slot

# A shared prefix shorter than this (a chat template's opening) neither steers
# a request to a slot nor is copied or waited for.
MIN_SHARED_PREFIX = 32

# Make the target slot's KV the source slot's first `count` tokens (the
# target's own dropped); how many were copied (0: none).
CopyPrefix = Callable[[Slot, Slot, int], int]


@dataclass
class Choice:
    """The free slot a new request takes, the prefix of its prompt the slot's
    own cache holds (`shared`), and the slot in use it could copy a longer
    prefix from (`donor`, None where there is none) with that prefix's length
    (`lent`)."""

    slot: Slot
    shared: int
    donor: Slot | None
    lent: int


class PrefixSharing:
    """Choosing a slot by its cached prefix, and copying prefixes between
    slots, for one model's slots. The backend gives its KV groups (`group_of`)
    and, where it can share KV between slots, its `copy` (`across_groups`:
    also between slots of different groups); it passes its slots to each
    call. `enabled` is the model's `prompt_cache` (changed live)."""

    def __init__(
        self,
        *,
        group_of: Callable[[Slot], int],
        copy: CopyPrefix | None = None,
        across_groups: bool = False,
        enabled: bool = True,
    ) -> None:
        self.group_of = group_of
        self._copy = copy
        self.across_groups = across_groups
        self.enabled = enabled
        # Prompt tokens copied from a slot in use instead of evaluated.
        self.copied_tokens = 0

    def choose(
        self, slots: list[Slot], prompt: list[int], *, whole: bool, salt: str = ""
    ) -> Choice:
        """Where a new request with this prompt and cache salt goes (`whole`:
        its prompt is read whole, for its log-probabilities: nothing is taken
        from a cache or another slot)."""
        lent_in = {} if whole else self._busy_prefixes(slots, prompt, salt)
        slot, shared = self._cached_slot(slots, prompt, lent_in, salt)
        donor, lent = self._lender(lent_in, self.group_of(slot))
        return Choice(slot, 0 if whole else shared, donor, lent)

    def copy(self, source: Slot, target: Slot, count: int, prompt: list[int]) -> int:
        """Give the target slot the source's first `count` tokens of the
        prompt (its KV and `tokens`); how many it got (0: none, nothing
        changed in `tokens`)."""
        copied = self._copy(source, target, count) if self._copy is not None else 0
        if copied:
            target.tokens[:] = prompt[:copied]
            self.copied_tokens += copied
        return copied

    def settle_awaiting(
        self, slots: list[Slot], fail: Callable[[Slot, str], None]
    ) -> None:
        """Slots waiting for a prefix another slot was reading: copy it once
        read (or what is left of it, if that slot's request ended or failed
        first); then they read the rest of their prompt. A copy that raises
        fails its slot's request (`fail`). Run before a step."""
        for slot in sorted(slots, key=lambda s: s.used_at):
            if slot.request is None or slot.awaiting is None:
                continue
            donor, request, count = slot.awaiting
            if donor.request is request and len(donor.tokens) < count:
                continue  # still reading it
            slot.awaiting = None
            prompt = slot.request.prompt_tokens
            available = common_prefix(donor.tokens[:count], prompt)
            if available <= slot.n_past:
                continue
            try:
                copied = self.copy(donor, slot, available, prompt)
            except Exception as error:
                fail(slot, f"copying a cached prefix failed: {error!r}")
                continue
            if copied:
                slot.n_past = slot.cached = copied
                slot.todo = list(prompt[copied:])

    def _cached_slot(
        self,
        slots: list[Slot],
        prompt: list[int],
        lent_in: dict[int, tuple[Slot, int]],
        salt: str,
    ) -> tuple[Slot, int]:
        """The free slot to take: the one that starts with the longest prefix
        of the prompt, from its own cache or copied from a slot in use in its
        group (ties: the slot whose cache loses the fewest tokens, those past
        the prefix it shares, then the one holding more of it itself, so that
        a conversation's next turn keeps its own slot and no other
        conversation's cache is dropped for a prefix a slot in use could
        lend; then the KV group whose requests hold the fewest tokens, then
        the least recently used slot); and its own cache's share."""
        held: Counter[int] = Counter()
        for slot in slots:
            if slot.request is not None:
                held[self.group_of(slot)] += len(slot.tokens) + len(slot.todo)
        best, best_key, best_shared = None, None, 0
        for slot in slots:
            if slot.request is not None:
                continue
            group = self.group_of(slot)
            mine = self.enabled and slot.salt == salt
            shared = common_prefix(slot.tokens, prompt) if mine else 0
            score = max(shared, self._lender(lent_in, group)[1])
            if score < MIN_SHARED_PREFIX:
                score = 0
            lost = len(slot.tokens) - shared
            key = (score, -lost, shared, -held[group], -slot.used_at)
            if best_key is None or key > best_key:
                best, best_key, best_shared = slot, key, shared
        return best, best_shared

    def _busy_prefixes(
        self, slots: list[Slot], prompt: list[int], salt: str
    ) -> dict[int, tuple[Slot, int]]:
        """Per KV group, the slot in use whose tokens share the longest prefix
        with the prompt (a slot still reading its prompt: the prompt it will
        hold; ties: the one holding more of it now), and that prefix's length
        (empty: nothing to copy)."""
        best: dict[int, tuple[Slot, int]] = {}
        ready: dict[int, int] = {}
        if not self.enabled or self._copy is None:
            return best
        for slot in slots:
            if slot.request is None or slot.salt != salt:
                continue
            held = slot.request.prompt_tokens if slot.todo else slot.tokens
            shared = common_prefix(held, prompt)
            if shared < MIN_SHARED_PREFIX:
                continue
            now = min(shared, len(slot.tokens))
            group = self.group_of(slot)
            if (shared, now) > (best.get(group, (None, 0))[1], ready.get(group, 0)):
                best[group], ready[group] = (slot, shared), now
        return best

    def _lender(
        self, lent_in: dict[int, tuple[Slot, int]], group: int
    ) -> tuple[Slot | None, int]:
        """The slot in use a slot of `group` would copy a prefix from: one in
        its group, else (where the backend copies across groups) the one with
        the longest prefix in any group."""
        if group in lent_in or not self.across_groups:
            return lent_in.get(group, (None, 0))
        return max(lent_in.values(), key=lambda lent: lent[1], default=(None, 0))


def common_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many leading tokens the two lists share."""
    shared = 0
    for have, want in zip(cached, prompt, strict=False):
        if have != want:
            break
        shared += 1
    return shared
