"""Top-level URL routes of the front."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from api.health import healthz, metrics_view

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("v1/", include("api.urls")),
    path("healthz", healthz),
    path("metrics", metrics_view),
]
