"""Routes of the OpenAI-compatible API (mounted at /v1/)."""

from django.urls import path, re_path

from . import views

urlpatterns = [
    path("models", views.models),
    path("chat/completions", views.chat_completions),
    path("completions", views.completions),
    path("embeddings", views.embeddings),
    path("openapi.json", views.openapi),
    re_path(r"^(?P<path>.*)$", views.not_found),
]
