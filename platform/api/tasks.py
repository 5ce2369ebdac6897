"""Celery tasks of the API: beat's hourly pass that deletes stored responses
past their retention (api.dialects.responses_store)."""

import logging

from celery import shared_task

from .dialects.responses_store import stored_responses_expire

logger = logging.getLogger(__name__)


@shared_task(name="api.expire_stored_responses")
def expire_stored_responses() -> int:
    """Delete the stored responses past their retention; how many. A pass
    that fails is logged and ends there (what it deleted stays deleted): the
    next pass takes up what is left."""
    try:
        return stored_responses_expire()
    except Exception:
        logger.exception("Deleting expired stored responses failed")
        return 0
