"""WebSocket chat, chat page and dashboard."""
