"""Prompt caching, shared by the slot backends (engines/generation/slots.py).

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
another group where the backend can."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.generation.slot import Slot

# A shared prefix shorter than this (a chat template's opening) neither steers
# a request to a slot nor is copied or waited for.
MIN_SHARED_PREFIX = 32


class PrefixSharing:
    """Choosing a slot by its cached prefix, and copying prefixes between
    slots; mixed into SlotBackend, whose slots, KV groups and settings
    (`prompt_cache`, `copies_prefix`, `copies_across_groups`) it reads."""

    def _cached_slot(
        self, prompt: list[int], lent_in: dict[int, tuple["Slot", int]]
    ) -> tuple["Slot", int]:
        """The free slot to take: the one that starts with the longest prefix
        of the prompt, from its own cache or copied from a slot in use in its
        group (ties: the KV group whose requests hold the fewest tokens, then
        the least recently used slot); and its own cache's share."""
        held = [0] * self.kv_groups
        for slot in self.slots:
            if slot.request is not None:
                held[self.group_of(slot)] += len(slot.tokens) + len(slot.todo)
        best, best_key, best_shared = None, None, 0
        for slot in self.slots:
            if slot.request is not None:
                continue
            group = self.group_of(slot)
            shared = common_prefix(slot.tokens, prompt) if self.prompt_cache else 0
            score = max(shared, self._lender(lent_in, group)[1])
            if score < MIN_SHARED_PREFIX:
                score = 0
            key = (score, -held[group], -slot.used_at)
            if best_key is None or key > best_key:
                best, best_key, best_shared = slot, key, shared
        return best, best_shared

    def _busy_prefixes(self, prompt: list[int]) -> dict[int, tuple["Slot", int]]:
        """Per KV group, the slot in use whose tokens share the longest prefix
        with the prompt (a slot still reading its prompt: the prompt it will
        hold; ties: the one holding more of it now), and that prefix's length
        (empty: nothing to copy)."""
        best: dict[int, tuple[Slot, int]] = {}
        ready: dict[int, int] = {}
        if not (self.prompt_cache and self.copies_prefix):
            return best
        for slot in self.slots:
            if slot.request is None:
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
        self, lent_in: dict[int, tuple["Slot", int]], group: int
    ) -> tuple["Slot | None", int]:
        """The slot in use a slot of `group` would copy a prefix from: one in
        its group, else (where the backend copies across groups) the one with
        the longest prefix in any group."""
        if group in lent_in or not self.copies_across_groups:
            return lent_in.get(group, (None, 0))
        return max(lent_in.values(), key=lambda lent: lent[1], default=(None, 0))

    def settle_awaiting(self) -> None:
        """Slots waiting for a prefix another slot was reading: copy it once
        read (or what is left of it, if that slot's request ended or failed
        first); then they read the rest of their prompt. Run before a step."""
        for slot in sorted(self.slots, key=lambda s: s.used_at):
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
                copied = self._copy_prefix(donor, slot, available)
            except Exception as error:
                self.fail(slot, f"copying a cached prefix failed: {error!r}")
                continue
            if copied:
                slot.tokens[:] = prompt[:copied]
                slot.n_past = slot.cached = copied
                slot.todo = list(prompt[copied:])
                self.copied_tokens += copied

    def _copy_prefix(self, source: "Slot", target: "Slot", count: int) -> int:
        """Make the target's KV the source's first `count` tokens (the target's
        own dropped; both in one KV group unless copies_across_groups); how
        many were copied. Backends that cannot share KV between slots
        (copies_prefix False) copy nothing."""
        return 0


def common_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many leading tokens the two lists share."""
    shared = 0
    for have, want in zip(cached, prompt, strict=False):
        if have != want:
            break
        shared += 1
    return shared
