"""Top-level URL routes of the front."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from api import views as api_views

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("v1/", include("api.urls")),
    path("healthz", api_views.healthz),
    path("metrics", api_views.metrics_view),
]
