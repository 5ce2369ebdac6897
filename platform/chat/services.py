"""Writes of conversations: one chat turn (what was asked, what was answered)
stored in one transaction, once its answer has ended."""

from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.db.models import QuerySet

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
    # False when the caller went away mid-answer: nobody saw it whole.
    delivered: bool = True


def conversation_turn_record(
    *,
    user,
    key: ApiKey | None,
    conversation: int | None,
    messages: list[dict],
    regenerate: bool,
    answer: Answer,
    turn_id: str = "",
) -> Conversation:
    """Store a turn: a new conversation from `messages` (its system message
    as the system prompt, the first user message as the title), or the last
    user message added to the caller's `conversation`; then the answer.
    `regenerate`: the answer replaces the conversation's last answer and no
    user message is added. A conversation not the caller's is never written:
    the turn starts a new one.

    `turn_id` (the client's id of the turn): a turn already stored under it,
    in `conversation` or (none given) in any of the caller's, is not stored
    again: the new answer replaces its answer where it stands, unless the new
    one was not delivered (its socket closed mid-answer), which leaves the
    stored one. A turn sent again after a reconnect is thus stored once,
    whichever of its two records comes first."""
    turn = {
        "user": user,
        "key": key,
        "conversation": conversation,
        "messages": messages,
        "regenerate": regenerate,
        "answer": answer,
        "turn_id": turn_id,
    }
    try:
        return _turn_stored(**turn)
    except IntegrityError:
        if not turn_id:
            raise
        # The same turn stored at the same moment by its other record (the
        # unique constraints on turn ids refused the second): now it is found.
        return _turn_stored(**turn)


@transaction.atomic
def _turn_stored(
    *,
    user,
    key: ApiKey | None,
    conversation: int | None,
    messages: list[dict],
    regenerate: bool,
    answer: Answer,
    turn_id: str,
) -> Conversation:
    owned = conversations_owned(user=user, key=key)
    if conversation is not None:
        owned = owned.filter(pk=conversation)
    if turn_id:
        stored = _turn_found(owned=owned, turn_id=turn_id, answer=answer)
        if stored is not None:
            return stored
    found = owned.select_for_update().first() if conversation is not None else None
    if found is None:
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
        found = Conversation(
            user=user,
            key=None if user else key,
            model=answer.model,
            title=" ".join(first_user.split())[:TITLE_CHARS],
            system_prompt=system,
            opening_turn=turn_id,
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
        turn_id=turn_id,
        **_answer_fields(answer),
    )
    found.model = answer.model
    found.save(update_fields=["model", "updated_at"])
    return found


def _turn_found(
    *, owned: QuerySet[Conversation], turn_id: str, answer: Answer
) -> Conversation | None:
    """The conversation already holding turn `turn_id`, its answer replaced
    by the new one (when delivered); None when no conversation holds it."""
    earlier = (
        Message.objects.select_for_update()
        .filter(conversation__in=owned, role=Message.Role.ASSISTANT, turn_id=turn_id)
        .first()
    )
    if earlier is None:
        # Its answer gone (regenerated since), the turn still opened one.
        return owned.filter(opening_turn=turn_id).first()
    found = earlier.conversation
    if not answer.delivered:
        return found
    for name, value in _answer_fields(answer).items():
        setattr(earlier, name, value)
    earlier.save()
    found.model = answer.model
    found.save(update_fields=["model", "updated_at"])
    return found


def _answer_fields(answer: Answer) -> dict:
    """An assistant message's fields for `answer`."""
    return {
        "content": answer.content,
        "model": answer.model,
        "engine": answer.engine,
        "finish_reason": answer.finish_reason,
        "error_code": answer.error_code,
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "first_token_ms": answer.first_token_ms,
        "total_ms": answer.total_ms,
    }
