"""Routes of Ollama's API (mounted at /api/ by roundhouse.urls)."""

from django.urls import path, re_path

from . import views

urlpatterns = [
    path("chat", views.chat),
    path("generate", views.generate),
    path("embed", views.embed),
    path("embeddings", views.embeddings),
    path("tags", views.tags),
    path("show", views.show),
    path("ps", views.ps),
    path("version", views.version),
    path("pull", views.pull),
    re_path(r"^(?P<path>.*)$", views.not_found),
]
