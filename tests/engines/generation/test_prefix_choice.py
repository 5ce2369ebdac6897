"""Which free slot a new request takes when a slot in use could lend the same
prefix its own cache holds (engines/generation/prefix_sharing.py): the slot
whose cache loses least, never another conversation's."""

from types import SimpleNamespace

from engines.generation.prefix_sharing import PrefixSharing
from engines.generation.slot import Slot

SYSTEM = list(range(100, 500))  # a shared ~400-token system prompt
QUESTION, ANSWER = list(range(600, 616)), list(range(700, 748))


def busy(index: int, tokens: list[int]) -> Slot:
    """A slot in use, its prompt read (a peer's turn under way)."""
    slot = Slot(index=index, tokens=list(tokens), used_at=index + 10)
    slot.request = SimpleNamespace(prompt_tokens=list(tokens))
    return slot


def test_a_next_turn_keeps_its_own_slot_when_a_busy_peer_holds_the_same_prefix():
    """Two conversations began with the same question (so the same greedy
    answer). One is in its next turn; the other's next turn arrives. Its own
    slot holds its whole conversation so far, and the busy peer could lend
    the same prefix: it takes its own slot, not the least recently used one,
    which holds a third conversation's cache (the tie broken by what each
    slot's cache would lose)."""
    sharing = PrefixSharing(group_of=lambda slot: 0, copy=lambda s, t, n: n)
    so_far = SYSTEM + QUESTION + ANSWER
    own = Slot(index=0, tokens=list(so_far), used_at=5)
    # The least recently used free slot: a third conversation's cache.
    other = Slot(index=1, tokens=SYSTEM + list(range(900, 980)), used_at=0)
    empty = Slot(index=2, used_at=0)  # never used
    peer = busy(3, so_far + list(range(800, 820)))
    prompt = so_far + list(range(810, 830))
    choice = sharing.choose([own, other, empty, peer], prompt, whole=False)
    assert choice.slot is own, choice.slot.index
    assert choice.shared == len(so_far)
    # A new conversation (only the system prompt shared) takes the empty
    # slot: nobody's cache is dropped for what a busy slot can lend.
    fresh = SYSTEM + list(range(1000, 1016))
    assert sharing.choose([own, other, empty, peer], fresh, whole=False).slot is empty
