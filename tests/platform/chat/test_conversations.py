"""Conversations and messages: owned by a user or a key (never neither), a
user reads only their own, and the admin browses them without editing."""

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.urls import reverse

from chat.models import Conversation, Message
from chat.selectors import conversation_of, conversations_of
from tests.factories import ApiKeyFactory

pytestmark = pytest.mark.django_db


def user(name: str):
    return get_user_model().objects.create_user(name, password="x")


def conversation(owner=None, key=None, **fields) -> Conversation:
    chat = Conversation.objects.create(user=owner, key=key, model="smol", **fields)
    Message.objects.create(conversation=chat, role="user", content="Hello there")
    Message.objects.create(
        conversation=chat,
        role="assistant",
        content="General Kenobi",
        model="smol",
        engine="cpu0",
        finish_reason="stop",
        prompt_tokens=12,
        completion_tokens=4,
        first_token_ms=35.5,
        total_ms=80.0,
    )
    return chat


def test_a_conversation_has_an_owner():
    """A user, a key, or both; with neither the database refuses it. The
    control: the same row with a key is stored."""
    with pytest.raises(IntegrityError), transaction.atomic():
        Conversation.objects.create(model="smol")
    assert Conversation.objects.create(model="smol", key=ApiKeyFactory()).pk


def test_a_user_reads_only_their_own():
    alice, bob = user("alice"), user("bob")
    mine, theirs = conversation(alice, title="mine"), conversation(bob)
    assert list(conversations_of(user=alice)) == [mine]
    found = conversation_of(user=alice, pk=mine.pk)
    assert [m.role for m in found.messages.all()] == ["user", "assistant"]
    with pytest.raises(Conversation.DoesNotExist):
        conversation_of(user=alice, pk=theirs.pk)


def test_the_admin_browses_conversations_read_only(admin_client):
    """The list shows each conversation with its message count; a
    conversation's page shows its messages with engine, usage and timings, and
    offers no saving; nothing can be added."""
    chat = conversation(user("carol"), title="About harbours")
    listing = admin_client.get(reverse("admin:chat_conversation_changelist"))
    assert listing.status_code == 200
    assert "About harbours" in listing.content.decode()
    page = admin_client.get(reverse("admin:chat_conversation_change", args=[chat.pk]))
    text = page.content.decode()
    assert page.status_code == 200
    assert "General Kenobi" in text and "cpu0" in text and "35.5" in text
    assert 'name="_save"' not in text
    add = admin_client.get(reverse("admin:chat_conversation_add"))
    assert add.status_code == 403


def test_searching_finds_a_conversation_by_what_was_said(admin_client):
    chat = conversation(user("dave"), title="first")
    conversation(user("erin"), title="second")
    found = admin_client.get(
        reverse("admin:chat_conversation_changelist"), {"q": "Kenobi"}
    )
    assert found.context["cl"].result_count == 2
    Message.objects.filter(conversation=chat).update(content="nothing")
    found = admin_client.get(
        reverse("admin:chat_conversation_changelist"), {"q": "Kenobi"}
    )
    assert [c.title for c in found.context["cl"].result_list] == ["second"]
