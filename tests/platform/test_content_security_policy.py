"""The front's Content Security Policy (roundhouse.middleware): on the chat
page, the dashboard, the admin and the login page, with the request's own
WebSocket URLs; a view's own policy is kept. (In a real browser, and what it
stops: tests/platform/chat/test_browser_safety.py.)"""

import pytest
from django.http import HttpResponse
from django.test import RequestFactory

from roundhouse.middleware import ContentSecurityPolicyMiddleware

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "path",
    [
        "/chat/",
        "/dashboard/",
        "/admin/",
        "/admin/catalog/modelconfig/",
        "/accounts/login/",
    ],
)
def test_pages_carry_the_policy(admin_client, path):
    """Each page's answer has the policy: only its own origin, data: images,
    its own host's WebSocket, no plugin, no framing."""
    response = admin_client.get(path)
    assert response.status_code == 200
    policy = response["Content-Security-Policy"]
    assert policy.startswith("default-src 'self'; script-src 'self';")
    assert "img-src 'self' data:" in policy
    assert "connect-src 'self' ws://testserver wss://testserver" in policy
    assert "object-src 'none'" in policy and "frame-ancestors 'none'" in policy


def test_a_views_own_policy_is_kept():
    """A response that sets its own policy keeps it; one without gets the
    front's (the control)."""

    def own(request):
        response = HttpResponse("x")
        response["Content-Security-Policy"] = "default-src 'none'"
        return response

    request = RequestFactory().get("/")
    kept = ContentSecurityPolicyMiddleware(own)(request)
    assert kept["Content-Security-Policy"] == "default-src 'none'"
    given = ContentSecurityPolicyMiddleware(lambda r: HttpResponse("x"))(request)
    assert given["Content-Security-Policy"].startswith("default-src 'self'")
