"""Top-level URL routes of the front (WebSocket routes: roundhouse.asgi)."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView

from api.health import healthz, metrics_view

# The apps' admin modules, found here rather than at start
# (settings: SimpleAdminConfig): loaded once, with the URLs.
admin.autodiscover()

urlpatterns = [
    path("", RedirectView.as_view(url="/chat/", permanent=False)),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("chat.urls")),
    path("", include("api.engine_ops_urls")),
    path("v1/", include("batches.urls")),
    path("v1/", include("api.urls")),
    path("api/", include("api.dialects.ollama.urls")),
    path("healthz", healthz),
    path("metrics", metrics_view),
]
