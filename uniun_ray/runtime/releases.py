"""A process's releases on their way: a client ends a lease one-way (control plane).

A finished or failed job's `release` is sent without waiting for the scheduler's answer, so a
job's control path is one round trip (`acquire`: submit and grant) plus a one-way message.
What the answer used to give, this keeps:

- order: the caller's next `acquire` carries the releases not sent yet and names those on
  their way (`take`); the scheduler applies the first and waits for the others before it
  decides that submit (`SchedulerService.acquire`), since Ray may run an async actor's calls
  out of order;
- nothing lost: `flush` sends what is not sent yet and waits for the answers at interpreter
  exit (atexit, which runs before Ray's own shutdown: Ray registered its handler at import,
  earlier) and before a `local_cluster` block's `ray.shutdown`. A release lost all the same
  (the process was killed) leaves a lease that is not renewed: the reaper reclaims it;
- what the caller reads next: the scheduler's view (status, the event log) ends the job a
  moment after the call returned; `astatus` (and the replay, before it reads the log) waits
  for this process's releases first (`settled`), so what it shows includes them;
- errors: an answer that is an error is logged here. The work's result stands: a lease
  reclaimed before its release arrived is in the scheduler's event log (`reclaim`), and a
  scheduler that restarted has forgotten the job anyway.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import threading

import ray

from .protocol import UnknownJob

log = logging.getLogger(__name__)

#: The longest `flush` waits for the answers of the releases on their way.
FLUSH_S = 5.0


class Releases:
    def __init__(self) -> None:
        self._unsent: list[tuple] = []  # (scheduler, job id, epoch, outcome): sent at the loop's next turn
        self._on_the_way: dict = {}     # a release's ObjectRef -> (job id, epoch)
        self._lock = threading.Lock()   # sent from event loops, answered on Ray's threads, flushed at exit
        self._flush_at_exit = False

    def send(self, scheduler, job_id: str, epoch: int, outcome: str) -> None:
        """End lease `epoch` of the job ("done" or "failed") without waiting for the answer.
        It leaves at the event loop's next turn, unless an `acquire` of this process takes it
        along before (`take`): a caller that starts its next job at once pays one call."""
        with self._lock:
            self._unsent.append((scheduler, job_id, epoch, outcome))
            if not self._flush_at_exit:
                atexit.register(self.flush)
                self._flush_at_exit = True
        asyncio.get_running_loop().call_soon(self._send_unsent)

    def take(self) -> tuple[tuple[tuple[str, int, str], ...], tuple[tuple[str, int], ...]]:
        """What the next `acquire` carries: the releases not sent yet (job id, epoch, outcome),
        which it delivers from now on, and the (job id, epoch) of those on their way."""
        with self._lock:
            unsent, self._unsent = self._unsent, []
            return tuple(entry[1:] for entry in unsent), tuple(self._on_the_way.values())

    def _send_unsent(self) -> None:
        with self._lock:
            unsent, self._unsent = self._unsent, []
        for scheduler, job_id, epoch, outcome in unsent:
            ref = scheduler.release.remote(job_id, epoch, outcome)
            with self._lock:
                self._on_the_way[ref] = (job_id, epoch)
            ref.future().add_done_callback(lambda answer, ref=ref, outcome=outcome:
                                           self._answered(ref, outcome, answer))

    def flush(self, timeout_s: float = FLUSH_S) -> None:
        """Send what is not sent yet, then wait until every release on its way is answered (or
        `timeout_s` passed)."""
        self._send_unsent()
        with self._lock:
            refs = list(self._on_the_way)
        if refs and ray.is_initialized():
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            except Exception:  # Ray is going down under us: the reaper reclaims what did not arrive
                log.debug("flushing %d releases failed", len(refs), exc_info=True)

    async def settled(self) -> None:
        """Send what is not sent yet, then wait (in an event loop) until every release on its
        way now is answered."""
        self._send_unsent()
        with self._lock:
            refs = list(self._on_the_way)
        await asyncio.gather(*(asyncio.wrap_future(ref.future()) for ref in refs), return_exceptions=True)

    def _answered(self, ref, outcome: str, answer) -> None:
        with self._lock:
            job_id, epoch = self._on_the_way.pop(ref)
        error = answer.exception()
        if error is not None:
            from ray.exceptions import RayActorError

            cause = getattr(error, "cause", None) or error
            lost = isinstance(error, (RayActorError, UnknownJob))   # the scheduler restarted: it forgot the job
            log.log(logging.DEBUG if lost else logging.WARNING,
                    "job %s: the release (%s) of lease %d was refused; the work's result stands: %s: %s",
                    job_id, outcome, epoch, type(cause).__name__, str(cause).splitlines()[0] if str(cause) else "")


RELEASES = Releases()
