"""A discrete-event simulation of a pool of accelerators (one by default), driving any
object with the policy API of SPEC §1, §5 and §6 (the real `SchedulerPolicy` or a baseline)
on a virtual clock. Every device has the same `DeviceProfile` and its own number of slots.

Entry point: ``simulate(policy, workload, device, devices=("dev0",), slots=1) -> SimResult``,
the policy built with the same `devices` and `slots`; ``SimResult.events`` is the event log of
`uniun_ray.events.schema`, every job event on a device naming it.

The simulator plays the runtime's part of the contract, and checks the policy's: it gives
the policy each model's step times per batch size (`set_step_profile`, R23) at the start,
submits jobs, reports foreground changes, calls `tick(now)` at `next_wakeup()`, runs each
Dispatch (swap first when asked, then prefill, then decode, costs from the
`DeviceProfile`), stops a revoked job at its next token boundary plus the revoke delay
and reports ``finish(..., "revoked")``, and reports ``"done"`` otherwise. A revoked job
that the policy answers with `Requeued` stays with it (R6) and is later dispatched to
resume: it re-prefills prompt + produced tokens and decodes the rest; any other revoked
job is over (a chat failed as preempted). A policy that breaks the contract (a job
dispatched to an unknown device, to a slot it does not have or that holds an unfinished job,
a swap on a device that holds any, a revoke of a job that is not running, a second revoke)
raises `ContractError`. With several slots a revoked job's slot may be handed over (R22): the
Dispatch that takes it joins at the boundary where the revoked job stops.

Costs the simulator charges, for one run of a job that has produced k of its n tokens:
``swap_s`` (when the Dispatch says swap), ``prefill_s`` of the context (prompt + k) less what
the device's prefix KV cache holds, after which the next token exists, then one decode step
per further token. Boundaries, where a revoke takes effect, are the end of the swap (no token
yet: a revoked load stops there), the end of every prefill chunk (`DeviceProfile.chunk_tokens`;
no new token before the last one: the chunks read stay cached for the resume), and every
decode step. A revoke whose next boundary is
the job's last token lets the job finish "done".
A swap is charged whenever the Dispatch asks for one; a Dispatch without swap for a model
that is not loaded on its device is a contract error. Every device starts empty.

On a device with slots (SPEC §6) the jobs dispatched to it compute together, as `batch`
describes: a job joins at the next step boundary after its Dispatch (at the end of the swap
while one is under way; at once on an idle device), a step gives every decoding job a token in
``step_s(b)`` of the b decoding and carries one prefill chunk of a joiner; a revoke stops that
job at the next step boundary (+ the revoke delay before its finish) and the others go on.
With one job on the device this is the one-job run above, to the float: S = 1 gives the event
log of a one-slot simulator, with ``slot`` and ``batch`` added.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from uniun_ray.policy import Dispatch, Job, Kind, Requeued, Revoke

from .batch import Epoch, Progress, plan
from ..events.schema import COLD, SWITCH
from .kvcache import KvCache
from .device import DeviceProfile, PROFILES
from ..events.schema import Event
from .workload import Flow, SimJob, Workload

#: Slots per device: one count for every device, or a count per device name (others: 1), or
#: AUTO: as the runtime's default ("auto", R25) has them, each device's count is the loaded
#: model's (`ModelSpeed.auto_slots`), given to the policy (`set_slots`) at each swap's end; 1 before.
AUTO = "auto"
Slots = int | Mapping[str, int] | str


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
    """One dispatch of a job: it holds its slot from `start` to its finish (R7's charge)."""

    state: _JobState
    device: "_Device"
    slot: int
    progress: Progress
    revoked: bool = False
    stopped: bool = False      # by its revoke, at a boundary; its finish follows the delay
    swap_kind: str | None = None   # the swap it began with, if any: cold, warm, switch
    abandoned: bool = False    # that swap was given up for a chat on another model (R13)


@dataclass
class _Device:
    """One device: its model, its slots, and the batch computing on it (`batch`)."""

    name: str
    slots: int
    kv_tokens: int                # each model's prefix cache, as the runtime gives each its own
    kv: dict[str, KvCache] = field(default_factory=dict)   # model -> its prefix KV cache
    model: str | None = None
    kept: set[str] = field(default_factory=set)   # models it held before: they come back as `keeps` says
    measured: set[str] = field(default_factory=set)   # models whose "auto" count it gave the policy (R25)
    ready: float = 0.0         # the end of the swap under way: nothing computes before it
    runs: dict[int, _Run] = field(default_factory=dict)      # slot -> its unfinished run
    joining: list[_Run] = field(default_factory=list)        # dispatched, join at the next boundary
    batch: list[_Run] = field(default_factory=list)          # computing, in the order they joined
    epoch: Epoch | None = None
    wake: float = math.inf     # the next boundary the device is visited at
    version: int = 0           # bumped when `wake` moves earlier


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
                 devices: tuple[str, ...] = ("dev0",), slots: Slots = 1) -> None:
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
        self._auto = slots == AUTO
        counts = slots if isinstance(slots, Mapping) else dict.fromkeys(devices, 1 if self._auto else slots)
        self._devices = {name: _Device(name, counts.get(name, 1), device.kv_cache_tokens)
                         for name in devices}
        self._last_wake: float = -math.inf
        for name in devices:  # R23: the step times the policy bounds a chat's step with
            for model, speed in device.models.items():
                policy.set_step_profile(model, name, speed.steps)

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
                event["device"] = run.device.name
        event.update(fields)
        self.events.append(event)

    # -- producers and the user ----------------------------------------------------------
    def _start_flow(self, fs: _FlowState) -> None:
        for _ in range(fs.flow.depth):
            self._next_step(fs)

    @staticmethod
    def _kv(device: _Device, model: str) -> KvCache:
        return device.kv.setdefault(model, KvCache(device.kv_tokens))

    @staticmethod
    def _conversation(state: _JobState) -> str | None:
        """The key of the conversation a job is a turn of (its flow's producer), if it is one."""
        flow = state.flow.flow if state.flow is not None else None
        return flow.producer if flow is not None and flow.conversation else None

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
        self._count_at_swap(action)
        device = self._check_dispatch(action)
        state = self._jobs[action.job_id]
        speed = self.device.speed(action.model_id)
        kind = self._swap_kind(device, action.model_id) if action.swap else None
        if action.swap:   # a model kept on the device keeps its KV; a copy back or a load starts without
            if self.device.keeps == COLD:
                device.kv = {}
            elif kind != SWITCH:
                device.kv.pop(action.model_id, None)
            device.ready = self.now + speed.swap_cost(kind)
        context = state.spec.prompt_tokens + state.produced
        cached = self._kv(device, action.model_id).take(state.job.id, self._conversation(state), context)
        progress = Progress(state.spec.prompt_tokens, context, state.spec.output_tokens, context - cached,
                            state.produced, int(action.tier))
        run = _Run(state, device, action.slot, progress, swap_kind=kind)
        self._running[action.job_id] = device.runs[action.slot] = run
        self._log("dispatch", state, swap=action.swap, tier=int(action.tier), slot=action.slot,
                  batch=len(device.runs), cached_tokens=cached, prefill_tokens=context - cached,
                  prefill_s=speed.prefill_s(context - cached))
        if action.swap:
            self._log("swap_start", state, **{"from": device.model})
            device.kept |= {device.model} - {None}
            device.model = action.model_id
            self._at(device.ready, self._swap_end, run)
        device.joining.append(run)
        self._wake_at(device, self._boundary(device))

    def _count_at_swap(self, action: Dispatch) -> None:
        """R25, as the policy keeps it: a swap to a model whose count the device gave before
        runs that count from its dispatch on (a model never measured there keeps the device's
        count until its swap's end)."""
        device = self._devices.get(action.device)
        if self._auto and action.swap and device is not None and action.model_id in device.measured:
            device.slots = self.device.speed(action.model_id).auto_slots

    def _check_dispatch(self, action: Dispatch) -> "_Device":
        """The device the Dispatch may run on, or a ContractError saying why not."""
        device = self._devices.get(action.device)
        where = f"t={self.now}: Dispatch({action.job_id!r}) to {action.device}"
        if device is None:
            raise ContractError(f"{where}: unknown device")
        if not 0 <= action.slot < device.slots:
            raise ContractError(f"{where} slot {action.slot}: it has {device.slots} slot(s)")
        busy = device.runs.get(action.slot)
        if busy is not None and not (busy.revoked and device.slots > 1):  # a handover (R22)
            raise ContractError(f"{where} slot {action.slot} while {busy.state.job.id!r} is running")
        state = self._jobs.get(action.job_id)
        if state is None or action.job_id not in self._outstanding or action.job_id in self._running:
            raise ContractError(f"t={self.now}: Dispatch of unknown, running or ended job {action.job_id!r}")
        if action.model_id != state.job.model_id:
            raise ContractError(f"{where} on {action.model_id!r}, the job wants {state.job.model_id!r}")
        held = sorted(repr(r.state.job.id) for r in self._running.values() if r.device is device) if action.swap else []
        if held:  # a revoked job whose slot was handed over still holds its device until it ends
            raise ContractError(f"{where} with a swap while {', '.join(held)} hold(s) it: "
                                "a device swaps only when empty")
        if not action.swap and action.model_id != device.model:
            raise ContractError(f"{where} without swap, but {device.model!r} is loaded there")
        return device

    def _swap_kind(self, device: _Device, model_id: str) -> str:
        """A model the device held before comes back as the profile `keeps` it; any other is cold."""
        return self.device.keeps if model_id in device.kept else COLD

    def _swap_end(self, run: _Run) -> None:
        """The swap's end, with its kind and time; then, as the runtime does once it measured
        a swap, what a swap back to each model the device keeps would cost (R12)."""
        if run.abandoned:
            return
        device = run.device
        self._log("swap_end", run.state, swap_kind=run.swap_kind,
                  seconds=self.device.speed(device.model).swap_cost(run.swap_kind))
        given = getattr(self.policy, "set_swap_cost", None)
        for model in sorted(device.kept - {device.model}) if given else ():
            given(model, device.name, self.device.speed(model).swap_cost(self.device.keeps))
        if self._auto:   # what the device chose for the model it loaded (R25)
            device.slots = self.device.speed(device.model).auto_slots
            device.measured.add(device.model)
            self._log("slots", device=device.name, model=device.model, slots=device.slots)
            self._apply(self.policy.set_slots(device.name, device.slots, self.now, model_id=device.model))

    def _abandon_swap(self, device: _Device) -> None:
        """R13, as the runtime does: a swap under way whose every job was revoked, with the
        device emptied for a job on another model (a chat), is given up at once; the device
        then holds no model, and the policy is told so."""
        drain = getattr(self.policy, "drains", {}).get(device.name)
        runs = list(device.runs.values())
        swapping = next((r for r in runs if r.swap_kind is not None and not r.abandoned), None)
        if (swapping is None or self.now >= device.ready or drain is None or not all(r.revoked for r in runs)
                or self._jobs[drain].job.model_id == device.model):
            return
        swapping.abandoned = True
        self._log("swap_end", swapping.state, swap_kind=swapping.swap_kind,
                  seconds=self.now - (device.ready - self.device.speed(device.model).swap_cost(swapping.swap_kind)),
                  abandoned=True)
        device.ready, device.model = self.now, None
        self._apply(self.policy.set_loaded_model(None, self.now, device=device.name))

    def _revoke(self, action: Revoke) -> None:
        run = self._running.get(action.job_id)
        if run is None:
            raise ContractError(f"t={self.now}: Revoke({action.job_id!r}) of a job that is not running")
        if run.revoked:
            raise ContractError(f"t={self.now}: second Revoke of {action.job_id!r}")
        run.revoked = True
        self._log("revoke", run.state, cause=action.cause.value, batch=len(run.device.runs))
        self._abandon_swap(run.device)
        self._wake_at(run.device, self._boundary(run.device))

    # -- the batch on a device ---------------------------------------------------------
    def _boundary(self, device: _Device) -> float:
        """When a job joins or stops if asked now: at the end of the swap under way, at the end
        of the step under way, or now if the device computes nothing."""
        if self.now < device.ready:
            return device.ready
        return self.now if device.epoch is None else device.epoch.boundary_after(self.now)

    def _wake_at(self, device: _Device, t: float) -> None:
        if t < device.wake:
            device.wake = t
            device.version += 1
            self._at(t, self._visit, (device, device.version))

    def _visit(self, arg: tuple[_Device, int]) -> None:
        """A step boundary where the batch changes: tokens up to now, first tokens, jobs that
        are done, revoked jobs that stop, jobs that join; then the steps until the next change."""
        device, version = arg
        if version != device.version:
            return
        device.wake = math.inf
        if device.epoch is not None:
            for job in device.epoch.advance(self.now):
                run = next(r for r in device.batch if r.progress is job)
                if not run.state.first_token_done:
                    run.state.first_token_done = True
                    self._log("first_token", run.state)
        done = [run for run in device.batch if run.progress.done]
        stopping = [run for run in device.batch + device.joining if run.revoked and not run.progress.done]
        device.batch = [run for run in device.batch + device.joining if not run.revoked and not run.progress.done]
        device.joining = []
        if device.batch:
            speed = self.device.speed(device.model)
            device.epoch = plan([run.progress for run in device.batch], self.now, speed, self.device.chunk_tokens(speed))
        else:
            device.epoch = None
        if device.epoch is not None:
            self._wake_at(device, device.epoch.end)
        for run in stopping:
            run.stopped = True
            self._at(self.now + self.device.revoke_delay_s, self._end, run)
        for run in done:
            self._end(run)

    def _end(self, run: _Run) -> None:
        state, device = run.state, run.device
        if run.stopped:          # kept for the resume: what the run had read by its stop
            self._kv(device, state.job.model_id).put(state.job.id, run.progress.kv_tokens())
        elif self._conversation(state) is not None:   # the next turn's prompt starts with it
            self._kv(device, state.job.model_id).put(self._conversation(state), state.spec.prompt_tokens + state.spec.output_tokens)
        state.produced = run.progress.tokens
        outcome = "revoked" if run.stopped else "done"
        self._log("finish", state, outcome=outcome, tokens=state.produced)
        del self._running[state.job.id]
        if device.runs.get(run.slot) is run:  # else its slot was handed over (R22)
            del device.runs[run.slot]
        actions = self.policy.finish(state.job.id, self.now, outcome)
        if Requeued(state.job.id) not in actions:
            self._outstanding.discard(state.job.id)
            if state.flow is not None:
                self._next_step(state.flow)
        self._apply(actions)


def simulate(policy, workload: Workload, device: DeviceProfile = PROFILES["cpu"],
             devices: tuple[str, ...] = ("dev0",), slots: Slots = 1) -> SimResult:
    """Run `workload` to completion under `policy` on `devices`, each a `device` with `slots`
    slots (the policy built with the same devices and slots)."""
    return Simulator(policy, workload, device, devices, slots).run()
