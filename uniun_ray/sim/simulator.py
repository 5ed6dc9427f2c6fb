"""A discrete-event simulation of a pool of accelerators (one by default), driving any
object with the policy API of SPEC §1 and §5 (the real `SchedulerPolicy` or a baseline) on
a virtual clock. Every device has the same `DeviceProfile`.

Entry point: ``simulate(policy, workload, device, devices=("dev0",)) -> SimResult``, the
policy built with the same `devices`; ``SimResult.events`` is the event log of
`uniun_ray.events.schema`, every job event on a device naming it.

The simulator plays the runtime's part of the contract, and checks the policy's: it
submits jobs, reports foreground changes, calls `tick(now)` at `next_wakeup()`, runs each
Dispatch (swap first when asked, then prefill, then decode, costs from the
`DeviceProfile`), stops a revoked job at its next token boundary plus the revoke delay
and reports ``finish(..., "revoked")``, and reports ``"done"`` otherwise. A revoked job
that the policy answers with `Requeued` stays with it (R6) and is later dispatched to
resume: it re-prefills prompt + produced tokens and decodes the rest; any other revoked
job is over (a chat failed as preempted). A policy that breaks the contract (a job
dispatched to a busy or unknown device, a revoke of a job that is not running, a second
revoke) raises `ContractError`.

Costs the simulator charges, for one run of a job that has produced k of its n tokens:
``swap_s`` (when the Dispatch says swap), ``prefill_s(prompt + k)`` after which the next
token exists, then ``decode_s`` per further token. Boundaries, where a revoke takes
effect, are the end of the swap (no token yet: a revoked load stops there), the end of
every prefill chunk of the profile's ``prefill_chunk`` tokens (no new token before the
last one: that prefill is lost), and every decode step. A revoke whose next boundary is
the job's last token lets the job finish "done".
A swap is charged whenever the Dispatch asks for one; a Dispatch without swap for a model
that is not loaded on its device is a contract error. Every device starts empty.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from uniun_ray.policy import Dispatch, Job, Kind, Requeued, Revoke

from .device import DeviceProfile, PROFILES
from ..events.schema import Event
from .workload import Flow, SimJob, Workload

#: Slack when rounding a revoke time up to the next token boundary (float noise).
_EPS = 1e-9


class ContractError(RuntimeError):
    """The driven policy broke the SPEC §1 contract."""


@dataclass
class SimResult:
    events: list[Event]
    end: float                # virtual time of the last event
    unfinished: list[str]     # jobs still outstanding when nothing more could happen
    wall_s: float             # real seconds the simulation took


@dataclass
class _JobState:
    spec: SimJob
    job: Job
    flow: "_FlowState | None"
    produced: int = 0
    first_token_done: bool = False


@dataclass
class _Run:
    """One dispatch of a job: the device is held from `start` to its finish."""

    state: _JobState
    device: str
    start: float
    compute_start: float   # after the swap
    first_boundary: float  # end of prefill: produced + 1 tokens exist
    decode_s: float
    chunk_s: float         # one full prefill chunk
    revoked: bool = False
    stop_boundary: float = math.inf  # the boundary a revoke stops at
    end_version: int = 0             # bumped when the end is rescheduled

    def tokens_at(self, boundary: float) -> int:
        """Tokens the job has produced at a boundary of this run."""
        if boundary < self.first_boundary:
            return self.state.produced
        steps = round((boundary - self.first_boundary) / self.decode_s)
        return self.state.produced + 1 + steps

    def last_boundary(self) -> float:
        remaining = self.state.spec.output_tokens - self.state.produced
        return self.first_boundary + (remaining - 1) * self.decode_s

    def next_boundary(self, t: float) -> float:
        if t <= self.compute_start:
            return self.compute_start
        if t <= self.first_boundary:
            chunks = math.ceil((t - self.compute_start) / self.chunk_s - _EPS)
            return min(self.compute_start + chunks * self.chunk_s, self.first_boundary)
        steps = math.ceil((t - self.first_boundary) / self.decode_s - _EPS)
        return self.first_boundary + steps * self.decode_s


@dataclass
class _FlowState:
    flow: Flow
    next_step: int = 0


@dataclass(order=True)
class _Pending:
    t: float
    seq: int
    handler: Callable[[Any], None] = field(compare=False)
    arg: Any = field(compare=False)


class Simulator:
    def __init__(self, policy, workload: Workload, device: DeviceProfile = PROFILES["cpu"],
                 devices: tuple[str, ...] = ("dev0",)) -> None:
        self.policy = policy
        self.workload = workload
        self.device = device
        self.now = 0.0
        self.events: list[Event] = []
        self._heap: list[_Pending] = []
        self._seq = 0
        self._jobs: dict[str, _JobState] = {}
        self._outstanding: set[str] = set()
        self._running: dict[str, _Run] = {}  # job id -> its run
        self._loaded: dict[str, str | None] = dict.fromkeys(devices)  # device -> its model
        self._last_wake: float = -math.inf

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        for arrival in self.workload.arrivals:
            self._at(arrival.t, self._submit, (arrival.job, None))
        for flow in self.workload.flows:
            self._at(flow.start, self._start_flow, _FlowState(flow))
        for change in self.workload.foreground:
            self._at(change.t, self._set_foreground, change)
        while True:
            # Tick at the policy's wake-up when it comes before the next event. A wake-up
            # not after the last one honoured is ignored: a policy asking for the past
            # cannot spin the loop.
            wake = self.policy.next_wakeup()
            nxt = self._heap[0].t if self._heap else None
            if wake is not None and wake > self._last_wake and (nxt is None or wake <= nxt):
                self._last_wake = wake
                self.now = max(self.now, wake)
                self._apply(self.policy.tick(self.now))
                continue
            if nxt is None:
                break
            item = heapq.heappop(self._heap)
            self.now = item.t
            item.handler(item.arg)
        return SimResult(self.events, self.now, sorted(self._outstanding), time.perf_counter() - started)

    def _at(self, t: float, handler: Callable[[Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, _Pending(t, self._seq, handler, arg))
        self._seq += 1

    # -- the log -------------------------------------------------------------------------
    def _log(self, ev: str, state: _JobState | None = None, **fields) -> None:
        event: Event = {"t": self.now, "ev": ev}
        if state is not None:
            job = state.job
            event.update(job=job.id, kind=job.kind.value, producer=job.producer, model=job.model_id)
            run = self._running.get(job.id)
            if run is not None:
                event["device"] = run.device
        event.update(fields)
        self.events.append(event)

    # -- producers and the user ----------------------------------------------------------
    def _start_flow(self, fs: _FlowState) -> None:
        for _ in range(fs.flow.depth):
            self._next_step(fs)

    def _next_step(self, fs: _FlowState) -> None:
        flow, n = fs.flow, fs.next_step
        if not flow.has_step(n):
            return
        t = self.now + flow.steps[n % len(flow.steps)].think_s
        if flow.stop is not None and t > flow.stop:
            return
        fs.next_step += 1
        self._at(t, self._submit_step, (fs, n))

    def _submit_step(self, arg: tuple[_FlowState, int]) -> None:
        fs, n = arg
        self._submit((fs.flow.job(n, self.now), fs))

    def _submit(self, arg: tuple[SimJob, _FlowState | None]) -> None:
        spec, fs = arg
        job = spec.job
        if job.id in self._jobs:
            raise ValueError(f"workload {self.workload.name!r}: job id {job.id!r} submitted twice")
        state = _JobState(spec, job, fs)
        self._jobs[job.id] = state
        self._outstanding.add(job.id)
        self._log("submit", state, deadline=job.deadline, foreground_hint=job.foreground_hint,
                  subject=job.subject, prompt_tokens=spec.prompt_tokens, output_tokens=spec.output_tokens)
        self._apply(self.policy.submit(job, self.now))

    def _set_foreground(self, change) -> None:
        kind = None if change.kind is None else Kind.parse(change.kind)
        self._log("foreground", kind=change.kind, subject=change.subject)
        self._apply(self.policy.set_foreground(kind, self.now, subject=change.subject))

    # -- the device ----------------------------------------------------------------------
    def _apply(self, actions) -> None:
        for action in actions:
            if isinstance(action, Dispatch):
                self._dispatch(action)
            elif isinstance(action, Revoke):
                self._revoke(action)
            elif not isinstance(action, Requeued):  # `_end` reads it before applying
                raise ContractError(f"unknown action {action!r}")

    def _dispatch(self, action: Dispatch) -> None:
        where = action.device
        if where not in self._loaded:
            raise ContractError(f"t={self.now}: Dispatch({action.job_id!r}) to unknown device {where!r}")
        busy = next((r for r in self._running.values() if r.device == where), None)
        if busy is not None:
            raise ContractError(f"t={self.now}: Dispatch({action.job_id!r}) to {where} while "
                                f"{busy.state.job.id!r} is running")
        state = self._jobs.get(action.job_id)
        if state is None or action.job_id not in self._outstanding or action.job_id in self._running:
            raise ContractError(f"t={self.now}: Dispatch of unknown, running or ended job {action.job_id!r}")
        if action.model_id != state.job.model_id:
            raise ContractError(f"t={self.now}: Dispatch({action.job_id!r}) on {action.model_id!r}, "
                                f"the job wants {state.job.model_id!r}")
        if not action.swap and action.model_id != self._loaded[where]:
            raise ContractError(f"t={self.now}: Dispatch({action.job_id!r}) without swap, "
                                f"but {self._loaded[where]!r} is loaded on {where}")
        speed = self.device.speed(action.model_id)
        swap_s = speed.swap_s if action.swap else 0.0
        compute_start = self.now + swap_s
        prefill = speed.prefill_s(state.spec.prompt_tokens + state.produced)
        run = _Run(state, where, self.now, compute_start, compute_start + prefill, speed.decode_s,
                   speed.prefill_s(self.device.prefill_chunk))
        self._running[action.job_id] = run
        self._log("dispatch", state, swap=action.swap, tier=int(action.tier))
        if action.swap:
            self._log("swap_start", state, **{"from": self._loaded[where]})
            self._loaded[where] = action.model_id
            self._at(compute_start, self._swap_end, run)
        if not state.first_token_done:
            self._at(run.first_boundary, self._first_token, run)
        self._at(run.last_boundary(), self._end, (run, run.end_version))

    def _swap_end(self, run: _Run) -> None:
        self._log("swap_end", run.state)

    def _first_token(self, run: _Run) -> None:
        if run.first_boundary <= run.stop_boundary:
            run.state.first_token_done = True
            self._log("first_token", run.state)

    def _revoke(self, action: Revoke) -> None:
        run = self._running.get(action.job_id)
        if run is None:
            raise ContractError(f"t={self.now}: Revoke({action.job_id!r}) of a job that is not running")
        if run.revoked:
            raise ContractError(f"t={self.now}: second Revoke of {action.job_id!r}")
        run.revoked = True
        self._log("revoke", run.state)
        boundary = run.next_boundary(self.now)
        if boundary >= run.last_boundary() - _EPS:
            return  # the job ends at this boundary anyway: it finishes "done"
        run.stop_boundary = boundary
        run.end_version += 1
        self._at(boundary + self.device.revoke_delay_s, self._end, (run, run.end_version))

    def _end(self, arg: tuple[_Run, int]) -> None:
        run, version = arg
        if version != run.end_version:
            return
        state = run.state
        stopped = run.stop_boundary < math.inf
        state.produced = run.tokens_at(run.stop_boundary) if stopped else state.spec.output_tokens
        outcome = "revoked" if stopped else "done"
        self._log("finish", state, outcome=outcome, tokens=state.produced)
        del self._running[state.job.id]
        actions = self.policy.finish(state.job.id, self.now, outcome)
        if Requeued(state.job.id) not in actions:
            self._outstanding.discard(state.job.id)
            if state.flow is not None:
                self._next_step(state.flow)
        self._apply(actions)


def simulate(policy, workload: Workload, device: DeviceProfile = PROFILES["cpu"],
             devices: tuple[str, ...] = ("dev0",)) -> SimResult:
    """Run `workload` to completion under `policy` on `devices`, each a `device`."""
    return Simulator(policy, workload, device, devices).run()
