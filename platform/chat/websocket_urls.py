"""WebSocket routes of the chat app (routed in roundhouse.asgi)."""

from django.urls import path

from .consumers import ChatConsumer
from .dashboard import DashboardConsumer

websocket_urlpatterns = [
    path("ws/chat/", ChatConsumer.as_asgi()),
    path("ws/dashboard/", DashboardConsumer.as_asgi()),
]
