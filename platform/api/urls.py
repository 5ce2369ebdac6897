"""Routes of the OpenAI-compatible API (mounted at /v1/)."""

from django.urls import include, path, re_path

from . import pulls, views

urlpatterns = [
    path("models", views.models),
    path("models/<path:name>", pulls.model),
    path("chat/completions", views.chat_completions),
    path("completions", views.completions),
    path("embeddings", views.embeddings),
    path("pulls", pulls.pulls),
    path("pulls/<str:pull_id>", pulls.pull),
    path("pulls/<str:pull_id>/events", pulls.pull_stream),
    path("openapi.json", views.openapi),
    path("", include("api.dialects.responses_urls")),
    path("", include("api.dialects.anthropic.urls")),  # Anthropic's Messages
    re_path(r"^(?P<path>.*)$", views.not_found),
]
