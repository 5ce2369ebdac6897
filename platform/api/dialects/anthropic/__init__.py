"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`):
a translation at the edge onto the chat pipeline (protocol: the typed bodies;
translation: a body into a chat request, a reply into a message; serving: the
answer and its stream; views and urls: the routes)."""
