"""What one test of the front leaves behind that the next must not see:
limit counters, remembered and refused keys, throttled clients, users'
remembered limits, a database outage and the gateway's view of the fleet;
and the background threads' database connections (the usage writer's, the
snapshot loader's), which PostgreSQL needs closed to drop the test database.
The API tests and the WebSocket chat's use them (their conftest.py files)."""

from api import counters, selectors, services, usage
from api.gateway import front_gateway


def forget_keys() -> None:
    services._recent_keys.clear()
    services._stale_keys.clear()
    services._refused_keys.clear()
    services.AUTH_FAILURES.clear()
    services.DATABASE_OUTAGE.down = False
    services.DATABASE_OUTAGE.failed_at = -float("inf")
    selectors.user_allowances_forget()
    front_gateway().forget()  # the fleet read again at once, from this test's database


def front_forget() -> None:
    """Everything above, limit counters included."""
    counters.forget()
    forget_keys()


def close_background_connections() -> None:
    """Close the usage writer's and the snapshot loader's connections."""
    usage.usage_flush()
    front_gateway().close()
