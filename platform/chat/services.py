"""Writes of conversations: one chat turn (what was asked, what was answered)
stored in one transaction, once its answer has ended."""

from dataclasses import dataclass

from django.db import transaction

from api.models import ApiKey

from .models import Conversation, Message
from .selectors import conversations_owned

TITLE_CHARS = 80


@dataclass
class Answer:
    """How one streamed answer went, as the engine and the front saw it."""

    model: str
    engine: str = ""
    content: str = ""
    finish_reason: str = ""
    error_code: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_ms: float | None = None
    total_ms: float | None = None


@transaction.atomic
def conversation_turn_record(
    *,
    user,
    key: ApiKey | None,
    conversation: int | None,
    messages: list[dict],
    regenerate: bool,
    answer: Answer,
) -> Conversation:
    """Store a turn: a new conversation from `messages` (its system message
    as the system prompt, the first user message as the title), or the last
    user message added to the caller's `conversation`; then the answer.
    `regenerate`: the answer replaces the conversation's last answer and no
    user message is added. A conversation not the caller's is never written:
    the turn starts a new one."""
    found = None
    if conversation is not None:
        owned = conversations_owned(user=user, key=key).select_for_update()
        found = owned.filter(pk=conversation).first()
    if found is None:
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
        found = Conversation(
            user=user,
            key=None if user else key,
            model=answer.model,
            title=" ".join(first_user.split())[:TITLE_CHARS],
            system_prompt=system,
        )
        found.full_clean()
        found.save()
        asked = [m for m in messages if m["role"] != "system"]
    elif regenerate:
        last = found.messages.filter(role=Message.Role.ASSISTANT).last()
        if last is not None:
            last.delete()
        asked = []
    else:
        asked = [messages[-1]] if messages and messages[-1]["role"] == "user" else []
    Message.objects.bulk_create(
        [
            Message(conversation=found, role=m["role"], content=m["content"])
            for m in asked
        ]
    )
    Message.objects.create(
        conversation=found,
        role=Message.Role.ASSISTANT,
        content=answer.content,
        model=answer.model,
        engine=answer.engine,
        finish_reason=answer.finish_reason,
        error_code=answer.error_code,
        prompt_tokens=answer.prompt_tokens,
        completion_tokens=answer.completion_tokens,
        first_token_ms=answer.first_token_ms,
        total_ms=answer.total_ms,
    )
    found.model = answer.model
    found.save(update_fields=["model", "updated_at"])
    return found
