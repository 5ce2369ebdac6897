"""Routes of the Files and Batch APIs (mounted at /v1/, ahead of api.urls)."""

from django.urls import path

from . import views

urlpatterns = [
    path("files", views.files),
    path("files/<str:file_id>", views.file),
    path("files/<str:file_id>/content", views.file_content),
    path("batches", views.batches),
    path("batches/<str:batch_id>", views.batch),
    path("batches/<str:batch_id>/cancel", views.batch_cancel),
]
