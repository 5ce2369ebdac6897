"""The chat page (`/chat/`, `/chat/<id>/`): a logged-in user's conversations
and the models they can chat with. The answers stream over the WebSocket
(chat.consumers); the page only renders what is stored."""

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from catalog.selectors import models_for_chat

from .models import Conversation
from .selectors import conversation_of, conversations_of

# Conversations listed beside the chat, the most recent first.
LISTED = 50


def _as_page_data(conversation: Conversation | None) -> dict | None:
    if conversation is None:
        return None
    return {
        "id": conversation.pk,
        "model": conversation.model,
        "title": conversation.title,
        "system_prompt": conversation.system_prompt,
        "messages": [
            {
                "role": message.role,
                "content": message.content,
                "model": message.model,
                "engine": message.engine,
                "finish_reason": message.finish_reason,
                "error_code": message.error_code,
                "completion_tokens": message.completion_tokens,
                "first_token_ms": message.first_token_ms,
                "total_ms": message.total_ms,
            }
            for message in conversation.messages.all()
        ],
    }


@login_required
def chat_page(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    """GET /chat/ (a new conversation) or /chat/<id>/ (one of the user's)."""
    conversation = None
    if pk is not None:
        try:
            conversation = conversation_of(user=request.user, pk=pk)
        except Conversation.DoesNotExist:
            raise Http404("No such conversation.") from None
    listed = conversations_of(user=request.user).only("pk", "title", "model")
    return render(
        request,
        "chat/chat.html",
        {
            "conversations": listed[:LISTED],
            "current": conversation,
            "page_data": {
                "models": models_for_chat(),
                "conversation": _as_page_data(conversation),
            },
        },
    )
