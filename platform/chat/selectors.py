"""Reads of conversations: a user (or an API key) sees only their own."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from api.models import ApiKey

from .models import Conversation


def conversations_of(*, user: AbstractBaseUser) -> QuerySet[Conversation]:
    """The user's conversations, the most recently active first."""
    return Conversation.objects.filter(user=user)


def conversation_of(*, user: AbstractBaseUser, pk: int) -> Conversation:
    """One of the user's conversations with its messages in order;
    Conversation.DoesNotExist for anyone else's, as for one that does not
    exist (no telling them apart)."""
    return conversations_of(user=user).prefetch_related("messages").get(pk=pk)


def conversations_owned(
    *, user: AbstractBaseUser | None, key: ApiKey | None
) -> QuerySet[Conversation]:
    """The conversations of the WebSocket chat's caller: a logged-in user's,
    or (no user) an API key's own."""
    if user is not None:
        return conversations_of(user=user)
    return Conversation.objects.filter(key=key, user__isnull=True)
