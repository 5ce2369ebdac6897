"""Storing chat turns (chat.services.conversation_turn_record) with the
client's turn ids: a turn is stored once per conversation and id, whichever
of its records comes first; the database refuses a second one."""

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction

from chat.models import Conversation, Message
from chat.services import Answer, conversation_turn_record
from tests.factories import ApiKeyFactory

pytestmark = pytest.mark.django_db

ASKED = [{"role": "user", "content": "Name a colour."}]


def record(owner, *, turn_id="", conversation=None, **answer) -> Conversation:
    key = owner if not hasattr(owner, "get_username") else None
    return conversation_turn_record(
        user=None if key else owner,
        key=key,
        conversation=conversation,
        messages=ASKED,
        regenerate=False,
        answer=Answer(model="smol", **answer),
        turn_id=turn_id,
    )


def stored(conversation: Conversation) -> list[tuple[str, str]]:
    return list(conversation.messages.values_list("role", "content"))


def test_the_answer_that_was_seen_wins_in_either_order():
    """An interrupted answer (not delivered) stored first is replaced by its
    resend's; stored after the resend's, it leaves that one. Either way one
    user message and one answer. The control: without a turn id, each record
    is a turn of its own."""
    ada = get_user_model().objects.create_user("ada")
    first = record(ada, turn_id="t1", content="Bl", delivered=False)
    again = record(ada, turn_id="t1", content="Blue.", finish_reason="stop")
    assert again == first
    assert stored(first) == [("user", "Name a colour."), ("assistant", "Blue.")]

    resent = record(ada, turn_id="t2", content="Red.", finish_reason="stop")
    late = record(ada, turn_id="t2", content="R", delivered=False)
    assert late == resent
    assert stored(resent) == [("user", "Name a colour."), ("assistant", "Red.")]

    record(ada, content="Gr", delivered=False)
    record(ada, content="Green.")
    assert Conversation.objects.filter(user=ada).count() == 4


def test_a_turn_id_is_the_callers_own():
    """The same turn id from another user, or from an API key, is another
    turn: each stores its own conversation."""
    ada = get_user_model().objects.create_user("ada")
    bob = get_user_model().objects.create_user("bob")
    key = ApiKeyFactory()
    mine = record(ada, turn_id="same", content="a")
    theirs = record(bob, turn_id="same", content="b")
    keyed = record(key, turn_id="same", content="c")
    assert len({mine.pk, theirs.pk, keyed.pk}) == 3
    assert record(key, turn_id="same", content="d") == keyed
    assert stored(keyed)[-1] == ("assistant", "d")


def test_a_turn_answered_in_a_conversation_keeps_its_place():
    """A resend of an earlier turn replaces that answer where it stands; the
    later turn stays after it."""
    ada = get_user_model().objects.create_user("ada")
    chat = record(ada, turn_id="one", content="first")
    record(ada, turn_id="two", conversation=chat.pk, content="second")
    record(ada, turn_id="one", conversation=chat.pk, content="first, again")
    assert [content for role, content in stored(chat) if role == "assistant"] == [
        "first, again",
        "second",
    ]


def test_the_database_stores_a_turn_once():
    """Two answers to one turn id in one conversation, or two conversations
    of one owner opened by one turn id, are refused by the database (what
    makes records racing to store one turn safe). The control: an empty turn
    id is no id, and repeats."""
    ada = get_user_model().objects.create_user("ada")
    chat = Conversation.objects.create(user=ada, model="smol", opening_turn="t")
    Message.objects.create(conversation=chat, role="assistant", turn_id="t")
    with pytest.raises(IntegrityError), transaction.atomic():
        Message.objects.create(conversation=chat, role="assistant", turn_id="t")
    with pytest.raises(IntegrityError), transaction.atomic():
        Conversation.objects.create(user=ada, model="smol", opening_turn="t")
    Message.objects.create(conversation=chat, role="assistant")
    Message.objects.create(conversation=chat, role="assistant")
    Conversation.objects.create(user=ada, model="smol")
    Conversation.objects.create(user=ada, model="smol")
