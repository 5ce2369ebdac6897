"""Routes of OpenAI's Responses API (mounted at /v1/ by api.urls)."""

from django.urls import path

from . import responses

urlpatterns = [
    path("responses", responses.create),
    path("responses/<str:response_id>", responses.response),
    path("responses/<str:response_id>/input_items", responses.input_items),
]
