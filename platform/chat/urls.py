"""HTTP routes of the chat app: the chat page and the fleet dashboard
(WebSocket routes: websocket_urls)."""

from django.urls import path

from . import dashboard_views, views

urlpatterns = [
    path("chat/", views.chat_page, name="chat-new"),
    path("chat/<int:pk>/", views.chat_page, name="chat-conversation"),
    path("dashboard/", dashboard_views.dashboard_page, name="dashboard"),
    path(
        "dashboard/engines/<slug:name>/restart/",
        dashboard_views.engine_restart,
        name="dashboard-restart",
    ),
    path(
        "dashboard/engines/<slug:name>/load/",
        dashboard_views.model_load,
        name="dashboard-load",
    ),
    path(
        "dashboard/engines/<slug:name>/unload/",
        dashboard_views.model_unload,
        name="dashboard-unload",
    ),
]
