"""The warm start: the active chat model loaded on its device before the runtime says
it is ready, so that the first chat waits for no cold load.

`uniun-ray up` and `start()` wait for it (`UNIUN_WARM_START=0` skips it); `/health` answers 503
"loading" meanwhile. It loads on the pool's first device (the one the policy tries first) and
stands aside when the policy gave that device work or a model before or during the load: the
device then holds what the policy said, and the warm start changes nothing it knows.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class WarmStart:
    """The warm start of a `SchedulerService`: `ready` starts it and says what still loads."""

    def __init__(self, service) -> None:
        self.service = service
        self.loading: str | None = None   # "MODEL on DEVICE" while it loads
        self._task: asyncio.Task | None = None

    async def ready(self, wait: bool = True) -> str | None:
        """Start the warm start at the first call; with `wait`, return once it ended (a load
        that failed is the first chat's to meet again). What still loads, None when ready."""
        if self._task is None:
            device = next(iter(self.service.drivers))
            if self._idle(device):
                self.loading = f"{self.service.config.chat_model} on {device}"
            self._task = asyncio.get_running_loop().create_task(self._load(device))
        if wait:
            await asyncio.shield(self._task)
        return self.loading

    def _idle(self, device: str) -> bool:
        policy = self.service.policy
        return policy.loaded_models.get(device) is None and not policy.slot_jobs.get(device)

    async def _load(self, device: str) -> None:
        """Load the chat model on `device` (when `ready` found it idle); then, unless the policy
        gave it work or a model meanwhile, tell the policy what it holds (and its slots, R25)."""
        if self.loading is None:
            return
        service, model = self.service, self.service.config.chat_model
        driver = service.drivers[device]
        try:
            await driver.load(model)
        except Exception as error:   # the first chat's dispatch loads it again, and fails as a job does
            driver.lost()
            log.warning("the warm start of %s on %s failed: %s", model, device, error)
            return
        finally:
            self.loading = None
        if service.drivers.get(device) is driver and self._idle(device):
            service._apply(service.policy.set_loaded_model(model, service._now(), device=device))
            if driver.plan is not None:
                service._take_plan(device, model, driver.plan)
