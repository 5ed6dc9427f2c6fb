"""The real system beside the simulator: play a workload on the runtime, in real time,
and score it next to the simulation of the same work.

Why: the simulator is worth its predictions only if it predicts the real system. `play`
drives a `Workload` through the client API the way the simulator drives it — arrivals at
their times, closed-loop flows that submit their next step `think_s` after a slot frees,
foreground changes — with the simulator's job ids, then reads the SchedulerActor's event
log (the simulator's schema) from the start of the play. `compare` scores both logs with
`metrics.measure` and simulates the *realized* workload: each job's real context length
(chat template included) and the tokens it really generated (a model may end its answer
before `max_new_tokens`), so a gap is not different work. It simulates it twice, at the
profile's speeds and at the speeds the run showed, to separate a gap in the simulator's model
of the system from the machine being slower than its profile.

`main` (``uniun-ray bench --real``) runs each short workload on a private local Ray with
fresh actors and writes ``real-vs-sim.md``, both event logs and both timelines.
"""
from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .events import log
from .events.schema import Event, validate
from .events.trace import Trace
from .policy import SchedulerPolicy
from .sim import plots
from .sim.device import DeviceProfile, ModelSpeed
from .sim.metrics import measure, percentile
from .sim.simulator import SimResult, simulate
from .sim.workload import Arrival, Flow, FlowStep, SimJob, Workload
from .sim.workloads import generate

#: Prompt text, repeated to the length a job asks for; a story so the models keep writing.
_STORY = ("The lighthouse keeper kept a log of every night on the island: the wind and the tide, "
          "the ships that passed, the birds that rested on the rail, the letters from the mainland "
          "and the small repairs the old lamp needed before the winter storms. ").split()
_ASK = "Tell the rest of this story at length, in many sentences:"


def _text(words: int) -> str:
    return " ".join([_ASK, *(_STORY[i % len(_STORY)] for i in range(words))])


def _context(model_id: str, text: str, max_new_tokens: int) -> int:
    """Tokens the engine will prefill for `text` (template included); tokenizer only."""
    from uniun_ray.models import GenerateRequest, inspect_request, resolve

    return inspect_request(resolve(model_id), GenerateRequest(prompt=text, max_new_tokens=max_new_tokens))


@functools.lru_cache(maxsize=4096)
def prompt_for(model_id: str, context_tokens: int, max_new_tokens: int) -> tuple[str, int]:
    """A prompt whose context is the longest not over `context_tokens` (at least the
    instruction alone), and its real length: a search for the number of story words,
    started from the model's tokens per word."""
    def size(words: int) -> int:
        return _context(model_id, _text(words), max_new_tokens)

    base, per_word = _ratio(model_id)
    words = max(0, int((context_tokens - base) / per_word))
    while words > 0 and size(words) > context_tokens:
        words -= 1
    while size(words + 1) <= context_tokens:
        words += 1
    return _text(words), size(words)


@functools.lru_cache(maxsize=8)
def _ratio(model_id: str) -> tuple[int, float]:
    """The instruction's own context length, and story tokens per word, for a model."""
    base = _context(model_id, _text(0), 1)
    return base, (_context(model_id, _text(1000), 1) - base) / 1000


@dataclass
class Played:
    events: list[Event]          # the scheduler's log, t in seconds from the start of the play
    realized: Workload           # the workload with each played job's real sizes
    errors: list[str]
    wall_s: float
    load_avg: tuple[float, float]  # 1-min load average at the start and at the end


async def play(workload: Workload, timeout_s: float | None = None) -> Played:
    """Play `workload` on the running runtime, which must be fresh (nothing loaded, queued
    or run), as the simulator's device is. Every model is loaded once first (a first load
    converts the embedded GGUF), then unloaded, so the play starts on an empty device."""
    from uniun_ray.client import astatus
    from uniun_ray.runtime.releases import RELEASES

    status = await astatus()
    if status["loaded_model"] is not None or status["running"] is not None or status["queued"]:
        raise ValueError("play needs a fresh runtime: one that has loaded, run and queued nothing")
    await _prepare(workload)
    load_start = os.getloadavg()[0]
    player = _Player(time.time())
    tasks = ([player.arrival(a) for a in workload.arrivals] + [player.flow(f) for f in workload.flows]
             + [player.foreground(c) for c in workload.foreground])
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    except asyncio.TimeoutError:
        player.errors.append(f"timed out after {timeout_s:.0f} s: the jobs still out were cancelled")
    wall = player.now()
    await RELEASES.settled()   # the last jobs' releases are one-way: their finishes logged first
    events = [{**e, "t": e["t"] - player.t0} for e in log.read(status["event_log"]) if e["t"] >= player.t0]
    validate(events)
    return Played(events, realized(workload, player.sizes), player.errors, wall, (load_start, os.getloadavg()[0]))


async def _prepare(workload: Workload) -> None:
    """Every model loaded once (a first load converts the embedded GGUF), then unloaded, and
    every prompt built, before the clock starts."""
    from uniun_ray.runtime.launch import handles

    model = handles().model
    for model_id in sorted({a.job.job.model_id for a in workload.arrivals} | {f.model for f in workload.flows}):
        await model.load.remote(model_id)
    await model.unload.remote()
    for a in workload.arrivals:
        prompt_for(a.job.job.model_id, a.job.prompt_tokens, a.job.output_tokens)
    for f in workload.flows:
        for step in f.steps:
            prompt_for(f.model, step.prompt_tokens, step.output_tokens)


class _Player:
    """The workload's producers on the wall clock from ``t0``: each job a real generation, the
    sizes of those that ran kept (``sizes``), the errors a producer would see recorded."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.sizes: dict[str, SimJob] = {}
        self.errors: list[str] = []

    def now(self) -> float:
        return time.time() - self.t0

    async def until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))

    async def run_job(self, spec: SimJob) -> None:
        from uniun_ray.client import GenerationStream
        from uniun_ray.models import GenerateRequest
        from uniun_ray.runtime.protocol import new_job

        job = spec.job
        text, context = prompt_for(job.model_id, spec.prompt_tokens, spec.output_tokens)
        real = new_job(job.kind, job.model_id, producer=job.producer, job_id=job.id,
                       deadline=None if job.deadline is None else self.t0 + job.deadline,
                       foreground_hint=job.foreground_hint, subject=job.subject)
        stream = GenerationStream(real, GenerateRequest(prompt=text, max_new_tokens=spec.output_tokens))
        try:
            async for _ in stream:
                pass
        except Exception as error:  # recorded, and the play goes on as the producer's would
            self.errors.append(f"{job.id}: {type(error).__name__}: {error}")
            return
        self.sizes[job.id] = replace(spec, prompt_tokens=context, output_tokens=max(1, stream.completion.tokens))

    async def arrival(self, a: Arrival) -> None:
        await self.until(a.t)
        await self.run_job(a.job)

    async def flow(self, f: Flow) -> None:
        next_step = 0

        async def slot() -> None:
            nonlocal next_step
            while f.has_step(next_step):
                n = next_step
                at = self.now() + f.steps[n % len(f.steps)].think_s
                if f.stop is not None and at > f.stop:
                    return
                next_step += 1
                await self.until(at)
                await self.run_job(f.job(n, self.now()))

        await self.until(f.start)
        await asyncio.gather(*(slot() for _ in range(f.depth)))

    async def foreground(self, change) -> None:
        from uniun_ray.client import aset_foreground

        await self.until(change.t)
        await aset_foreground(change.kind, change.subject)


def realized(workload: Workload, sizes: dict[str, SimJob]) -> Workload:
    """`workload` with the sizes of the jobs that ran; a flow keeps only the steps it
    played (so the simulation submits no more), with their think times and deadlines."""
    def step(f: Flow, n: int) -> FlowStep:
        planned, spec = f.steps[n % len(f.steps)], sizes.get(f"{f.producer}#{n}")
        return planned if spec is None else replace(planned, prompt_tokens=spec.prompt_tokens,
                                                    output_tokens=spec.output_tokens)

    def played(f: Flow) -> int:
        return 1 + max((int(i.rsplit("#", 1)[1]) for i in sizes if i.rsplit("#", 1)[0] == f.producer), default=-1)

    flows = tuple(replace(f, steps=tuple(step(f, n) for n in range(played(f))), cycle=False)
                  for f in workload.flows)
    arrivals = tuple(replace(a, job=sizes.get(a.job.job.id, a.job)) for a in workload.arrivals)
    return replace(workload, name=workload.name + ":realized", flows=flows, arrivals=arrivals)


# -- measured beside predicted -------------------------------------------------------------
def speeds(trace: Trace, workload: Workload) -> dict[str, dict[str, float]]:
    """Per model, medians over the log: decode s/token and prefill s per 1k context tokens
    (from the end of the swap to the first token, so the real figure includes the lease
    hand-off) of jobs that ran once to the end, and swap seconds. Computed the same way
    for a real and a simulated log, so the two columns compare like with like."""
    size = {a.job.job.id: a.job for a in workload.arrivals}
    size |= {f"{f.producer}#{n}": f.job(n, 0.0) for f in workload.flows for n in range(len(f.steps))}
    out: dict[str, dict[str, list[float]]] = {}
    for rec in trace.jobs.values():
        spec = size.get(rec.job.id)
        if spec is None or len(rec.runs) != 1 or rec.outcome != "done" or rec.first_token is None:
            continue
        run, row = rec.runs[0], out.setdefault(rec.job.model_id, {})
        row.setdefault("prefill s/1k tok", []).append(
            1000 * (rec.first_token - run.start - run.swap_s) / spec.prompt_tokens)
        if spec.output_tokens > 1:
            row.setdefault("decode s/tok", []).append((run.end - rec.first_token) / (spec.output_tokens - 1))
    for swap in trace.swaps:
        out.setdefault(swap.model, {}).setdefault("swap s", []).append(swap.end - swap.start)
    return {model: {k: statistics.median(v) for k, v in row.items()} for model, row in out.items()}


def fitted(device: DeviceProfile, observed: dict[str, dict[str, float]]) -> DeviceProfile:
    """`device` with the speeds a run showed (`speeds` of its log) where it showed them: a
    prediction at the speeds the machine really had, so what is left of a gap is the model
    of the system, not the machine's load."""
    def fit(model: str, speed: ModelSpeed) -> ModelSpeed:
        seen = observed.get(model, {})
        return replace(speed, decode_s=seen.get("decode s/tok", speed.decode_s),
                       prefill_s_per_token=seen.get("prefill s/1k tok", 1000 * speed.prefill_s_per_token) / 1000,
                       swap_s=seen.get("swap s", speed.swap_s))
    return replace(device, name=f"{device.name} fitted", models={m: fit(m, s) for m, s in device.models.items()})


def _stops(trace: Trace) -> list[float]:
    """Revoke to the revoked run's end (the device handed over), per revoked run."""
    return [run.end - run.revoked_at for run in trace.runs if run.outcome == "revoked" and run.revoked_at is not None]


def cell(v) -> str:
    """A figure of the comparison as its tables show it."""
    return "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def compare(played: Played, device: DeviceProfile) -> tuple[str, list[Event]]:
    """Markdown, measured vs predicted for one play, at the profile's speeds and at the
    speeds the run showed; and the event log predicted at the profile's speeds."""
    rows, predicted = comparison(played, device)
    lines = ["| | measured (real Ray) | predicted (profile) | predicted (the run's speeds) |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | " + " | ".join(map(cell, values)) + " |" for name, values in rows]
    w = played.realized
    lines += ["", f"Real run: {played.wall_s:.0f} s wall, 1-min load average {played.load_avg[0]:.1f} at "
              f"the start and {played.load_avg[1]:.1f} at the end (2 cores: above 2, the engine shares "
              f"them with other work). Simulated in {predicted.wall_s:.2f} s, profile `{device.name}`; "
              f"{sum(len(f.steps) for f in w.flows) + len(w.arrivals)} jobs at their real sizes."]
    if played.errors:
        lines += ["", "Errors in the real run: " + "; ".join(played.errors)]
    return "\n".join(lines), predicted.events


def comparison(played: Played, device: DeviceProfile) -> tuple[list[tuple[str, list]], SimResult]:
    """Rows of (figure, [measured, predicted at the profile's speeds, predicted at the run's]),
    and the simulation at the profile's speeds."""
    real = Trace(played.events)
    observed = speeds(real, played.realized)
    predicted = simulate(SchedulerPolicy(), played.realized, device)
    at_observed = simulate(SchedulerPolicy(), played.realized, fitted(device, observed))
    traces = [real, Trace(predicted.events), Trace(at_observed.events)]
    metrics = [measure(t) for t in traces]

    def each(get) -> list:
        return [get(m) for m in metrics]

    rows = [
        ("jobs submitted / done", [f"{m.jobs} / {sum(r.outcome == 'done' for r in t.jobs.values())}"
                                   for m, t in zip(metrics, traces)]),
        ("span, first to last event s", each(lambda m: m.makespan_s)),
        ("chat turns", each(lambda m: m.chat_n)),
        ("chat TTFT p50 s", each(lambda m: m.ttft_p50)),
        ("chat TTFT p99 s", each(lambda m: m.ttft_p99)),
        ("chat delay p99 s (TTFT less own prefill)", each(lambda m: m.chat_delay_p99)),
        ("revokes", each(lambda m: m.revokes)),
        ("revoke to stop s, median / max", [" / ".join(cell(v) for v in (percentile(s, 50), max(s, default=None)))
                                            for s in map(_stops, traces)]),
        ("swaps", each(lambda m: m.swaps)),
        ("swap time s", each(lambda m: m.swap_s)),
        ("idle while work waited s", each(lambda m: m.idle_while_waiting_s)),
    ]
    for flow in sorted(set().union(*(m.service for m in metrics))):
        rows.append((f"service s: {flow}", [m.service.get(flow) for m in metrics]))
    seen = [speeds(t, played.realized) for t in traces]
    for model in sorted(set().union(*seen)):
        for key in ("prefill s/1k tok", "decode s/tok", "swap s"):
            values = [s.get(model, {}).get(key) for s in seen]
            if any(v is not None for v in values):
                rows.append((f"{model}: {key} (median)", values))
    return rows, predicted


def main(out: Path, seed: int, device: DeviceProfile, names: list[str]) -> int:
    """`uniun-ray bench --real`: each workload on its own private local Ray, fresh actors."""
    out.mkdir(parents=True, exist_ok=True)
    report = [f"# real runtime vs simulator (profile `{device.name}`, seed {seed})", ""]
    for name in names:
        workload = generate(name, seed)
        played = play_fresh(workload, out / f"events-{name}.jsonl")
        text, predicted = compare(played, device)
        log.write(played.events, out / f"real-{name}.jsonl")
        log.write(predicted, out / f"sim-{name}.jsonl")
        real, sim = Trace(played.events), Trace(predicted)
        window = (0.0, max(real.end, sim.end))
        plots.timeline(real, out / f"timeline-real-{name}.png", f"{name}: real Ray, measured", window)
        plots.timeline(sim, out / f"timeline-sim-{name}.png", f"{name}: simulator, predicted", window)
        report += [f"## {name}: {workload.description}", "", text, ""]
        print("\n".join(report[-4:]), flush=True)
    (out / "real-vs-sim.md").write_text("\n".join(report))
    return 0


def play_fresh(workload: Workload, event_log: Path) -> Played:
    """`play` on a private local Ray with fresh actors, whose scheduler logs to `event_log`."""
    from uniun_ray.runtime.launch import local_cluster

    event_log.unlink(missing_ok=True)
    span = max([f.stop or f.start for f in workload.flows] + [a.t for a in workload.arrivals])
    with local_cluster():
        start_fresh(event_log)
        return asyncio.run(play(workload, timeout_s=3 * span + 120))


def start_fresh(event_log: Path) -> None:
    """Start the runtime `play` needs, on the Ray this process is connected to: its scheduler
    logs to `event_log`, and no warm start loads the chat model before `start` returns (its
    device starts empty, as the simulator's does; `play` loads each model it needs itself)."""
    from uniun_ray.runtime.launch import start
    from uniun_ray.runtime.service import RuntimeConfig

    start(RuntimeConfig(event_log=str(event_log)), warm=False)
