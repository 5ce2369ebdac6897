"""Routes of Anthropic's Messages API (mounted at /v1/ by api.urls)."""

from django.urls import path

from . import views

urlpatterns = [
    path("messages", views.messages),
    path("messages/count_tokens", views.count_tokens),
]
