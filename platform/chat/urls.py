"""HTTP routes of the chat app (WebSocket routes: websocket_urls)."""

from django.urls import path

from . import views

app_name = "chat"

urlpatterns = [
    path("", views.chat_page, name="new"),
    path("<int:pk>/", views.chat_page, name="conversation"),
]
