"""The engine's watch, about once a second: temperatures (pause or resume all
work), models idle past their keep-alive, and the generation loop's health."""

import asyncio
import logging
from collections.abc import Callable

from engines.runtime.residency import Residency
from engines.runtime.thermal import READ_INTERVAL_S, ThermalGate

log = logging.getLogger("roundhouse.engine")


async def watch(
    thermal: ThermalGate,
    set_allowed: Callable[[bool], None],
    residency: Residency,
) -> None:
    """Run until cancelled. Probes are read off the loop: nvidia-smi may be slow."""
    loop = asyncio.get_running_loop()
    allowed = True
    unhealthy = ""
    while True:
        try:
            reason = await loop.run_in_executor(None, thermal.update)
        except Exception:  # a broken sensor must not stop the engine
            log.exception("reading temperatures failed")
            reason = ""
        if reason and allowed:
            log.warning("cooling: %s", reason)
        elif not reason and not allowed:
            log.info("cooled down: resuming")
        allowed = not reason
        set_allowed(allowed)
        try:
            await residency.expire_idle()
        except Exception:  # an unload that fails must not end the watch
            log.exception("unloading idle models failed")
        now_unhealthy = residency.unhealthy_reason()
        if now_unhealthy and not unhealthy:
            log.error("engine unhealthy: %s", now_unhealthy)
        elif unhealthy and not now_unhealthy:
            log.info("engine healthy again")
        unhealthy = now_unhealthy
        await asyncio.sleep(READ_INTERVAL_S)
