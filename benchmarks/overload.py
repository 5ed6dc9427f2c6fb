"""Overload (issue 6): 10,000 queued jobs from 100 producers against the real SchedulerActor.

    .venv/bin/python benchmarks/overload.py [--jobs 10000] [--producers 100] [--clients 4]
    .venv/bin/python benchmarks/overload.py --quick     # 300 jobs from 30 producers, 2 clients

A private local Ray (never a running cluster) and fresh actors. The producers are spread
over `--clients` Ray actors (separate processes, as real producers are); each producer
submits its share of the jobs at once (kinds nataraj, gana and extract in turn, model
`tiny`), so the whole load is queued within seconds, then every job speaks the client
protocol as `uniun_ray.client` does: long-poll `grant` under the process's session (one
`heartbeat` per process keeps all its waiters alive), `release` when granted (the work itself
is empty: this measures the control plane, not the model). `--no-session` polls per job as a
caller without a session does (each poll its own proof of life, capped at waiter_timeout/3).
Meanwhile a probe in the driver times `ping` and `status()` round trips every 20 ms, each
ping beside one to a bare actor (the control: what a round trip costs on this host at that
moment, whatever else runs on it). At the end the scheduler's event log is read back: every
job must end exactly once (one final finish "done", no drop, no duplicate dispatch).

Records a row per figure (section "runtime" of BENCHMARKS.md). `run_load` is what
tests/test_robustness.py runs at a smaller size.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

KINDS = ("nataraj", "gana", "extract")


def pct(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


class LoadClient:
    """One process of producers: submits its jobs (phase 1), then runs each job's
    grant/release loop (phase 2)."""

    def __init__(self) -> None:
        from uniun_ray.runtime.protocol import NAMESPACE, SCHEDULER_NAME

        self.scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
        self.specs = []

    async def submit(self, producers: list[str], per_producer: int) -> float:
        from uniun_ray.runtime.protocol import new_job

        for producer in producers:
            kind = KINDS[int(producer.rsplit(":", 1)[1]) % len(KINDS)]
            self.specs += [new_job(kind, "tiny", producer=producer, job_id=f"{producer}/{i}")
                           for i in range(per_producer)]
        started = time.perf_counter()
        await asyncio.gather(*(self.scheduler.submit.remote(spec) for spec in self.specs))
        return time.perf_counter() - started

    async def drain(self, poll_s: float, sessions: bool) -> dict:
        import uuid

        scheduler = self.scheduler
        session = uuid.uuid4().hex if sessions else None

        async def beat():
            while True:
                await asyncio.sleep(await scheduler.heartbeat.remote(session))
        beating = asyncio.ensure_future(beat()) if sessions else None
        leases, polls = Counter(), Counter()

        async def job(spec):
            while True:
                polls[spec.id] += 1
                lease = await scheduler.grant.remote(spec.id, poll_s, session)
                if lease is not None:
                    leases[spec.id] += 1
                    requeued = await scheduler.release.remote(spec.id, lease.epoch, "done")
                    assert requeued is False
                    return
        await asyncio.gather(*(job(spec) for spec in self.specs))
        if beating is not None:
            beating.cancel()
        return {"leases": dict(leases), "polls": sum(polls.values())}


class Control:
    """A bare actor: its `ping` round trip is the host's, with no queue behind it."""

    async def ping(self) -> str:
        return "ok"


async def probe(scheduler, control, stop: asyncio.Event, ping_every_s: float = 0.02, status_every: int = 10) -> dict:
    """Round trips of `ping` (every 20 ms, each followed by the control's) and `status()`
    (every 10th probe: a snapshot of the whole queue is the heaviest call there is, and the
    probe must not become the load), the deepest queue seen, and when the slowest ping was
    sent (seconds into the phase)."""
    pings, controls, statuses, deepest, n = [], [], [], 0, 0
    began, slowest, slowest_at = time.perf_counter(), 0.0, 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await scheduler.ping.remote()
        pings.append(time.perf_counter() - t)
        if pings[-1] > slowest:
            slowest, slowest_at = pings[-1], t - began
        t = time.perf_counter()
        await control.ping.remote()
        controls.append(time.perf_counter() - t)
        n += 1
        if n % status_every == 0:
            t = time.perf_counter()
            status = await scheduler.status.remote()
            statuses.append(time.perf_counter() - t)
            deepest = max(deepest, status["queued"])
        await asyncio.sleep(ping_every_s)
    return {"ping": pings, "control": controls, "status": statuses, "deepest": deepest, "slowest_at_s": slowest_at}


def check_exactly_once(events: list[dict], job_ids: set[str]) -> dict:
    """Every job submitted once and finished "done" exactly once; nothing dropped, reclaimed
    or failed. A job revoked before its first token (a lower-tier job arrived while its grant
    was prepared: extract outranks nataraj and gana) ends that turn "revoked" and is
    dispatched again, so dispatches = 1 + revoked turns."""
    per_job = defaultdict(Counter)
    for e in events:
        if "job" in e:
            per_job[e["job"]][e["ev"] if e["ev"] != "finish" else f"finish:{e['outcome']}"] += 1
    bad = {job: dict(c) for job, c in per_job.items()
           if c["submit"] != 1 or c["finish:done"] != 1 or c["dispatch"] != 1 + c["finish:revoked"]
           or c["drop"] or c["reclaim"] or c["finish:failed"]}
    missing = job_ids - set(per_job)
    return {"bad": bad, "missing": missing, "finished": sum(c["finish:done"] for c in per_job.values()),
            "revoked_turns": sum(c["finish:revoked"] for c in per_job.values())}


async def run_load(scheduler, jobs: int, producers: int, clients: int, sessions: bool = True,
                   poll_s: float = 60.0) -> dict:
    """Drive the load from `clients` LoadClient actors; probe each phase. Returns figures."""
    remote = ray.remote(num_cpus=0)(LoadClient)
    names = [f"load:{p}" for p in range(producers)]
    groups = [names[c::clients] for c in range(clients)]
    control = ray.remote(num_cpus=0)(Control).remote()
    await control.ping.remote()
    actors = [remote.remote() for _ in groups]
    per_producer = jobs // producers
    phases = {}
    started = time.perf_counter()
    try:
        for phase, calls in (("submit", lambda a, g: a.submit.remote(g, per_producer)),
                             ("drain", lambda a, g: a.drain.remote(poll_s, sessions))):
            stop = asyncio.Event()
            watcher = asyncio.ensure_future(probe(scheduler, control, stop))
            t = time.perf_counter()
            try:
                results = await asyncio.gather(*(calls(a, g) for a, g in zip(actors, groups)))
            finally:
                stop.set()
                phases[phase] = await watcher | {"wall_s": time.perf_counter() - t}
    finally:
        for actor in [*actors, control]:
            ray.kill(actor)
    leases = Counter()
    for result in results:
        leases.update(result["leases"])
    return {"jobs": jobs, "wall_s": time.perf_counter() - started, "leases": leases,
            "polls": sum(r["polls"] for r in results), "phases": phases}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--producers", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4, help="processes the producers are spread over")
    parser.add_argument("--no-session", action="store_true", help="poll per job, without a session heartbeat")
    parser.add_argument("--quick", action="store_true", help="300 jobs from 30 producers in 2 client processes")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.producers, args.clients = 300, 30, 2
    if args.jobs < 1 or args.producers < 1 or args.clients < 1 or args.jobs % args.producers:
        parser.error("--jobs, --producers and --clients must be >= 1, and --jobs a multiple of --producers")

    from record import Record

    from uniun_ray.events.log import read
    from uniun_ray.runtime.launch import init_local, start
    from uniun_ray.runtime.service import RuntimeConfig

    log = os.path.join(tempfile.mkdtemp(prefix="uniun-overload-"), "events.jsonl")
    init_local()
    config = RuntimeConfig(event_log=log, event_log_max_bytes=1 << 30, max_queued=args.jobs)
    h = start(config)
    ray.get(h.model.load.remote("tiny"))
    figures = asyncio.run(run_load(h.scheduler, args.jobs, args.producers, args.clients, not args.no_session))
    once = check_exactly_once(read(log), set(figures["leases"]))
    ray.shutdown()

    submit, drain = figures["phases"]["submit"], figures["phases"]["drain"]

    def rtt(values, digits=1):
        return " / ".join(f"{1000 * pct(values, q):.{digits}f}" for q in (0.5, 0.99, 1.0)) + f" ms (n={len(values)})"

    granted_once = sum(1 for n in figures["leases"].values() if n == 1)
    record = Record("runtime", quick=args.quick)
    what = f"{figures['jobs']:,} jobs from {args.producers} producers in {args.clients} processes"
    record.row(f"{what}: all queued in (the submit burst)", f"{submit['wall_s']:.1f} s")
    record.row(f"{what}: drained (every job granted and released) in",
               f"{drain['wall_s']:.1f} s ({figures['jobs'] / drain['wall_s']:,.0f} jobs/s); deepest queue "
               f"{max(submit['deepest'], drain['deepest']):,}; {figures['polls']:,} grant calls")
    record.row(f"{what}: `ping` to the scheduler during the submit burst, p50 / p99 / max", rtt(submit["ping"]))
    record.row(f"{what}: `ping` to the scheduler while draining, p50 / p99 / max", rtt(drain["ping"]))
    record.row(f"{what}: a bare actor's round trip while draining (the control), p50 / p99 / max",
               rtt(drain["control"]))
    record.row(f"{what}: `status()` while draining, p50 / p99 / max", rtt(drain["status"], 0))
    record.row(f"{what}: jobs granted exactly once; ended exactly once in the event log (one finish "
               f"\"done\", no drop)", f"{granted_once:,}; {once['finished']:,} ({len(once['bad']) + len(once['missing'])} "
               f"anomalies)", goal="every job (issue 6)",
               met=granted_once == once["finished"] == figures["jobs"] and not once["bad"] and not once["missing"])
    if args.no_session:
        record.row(f"{what}: waiters' liveness", "per job polls (no session)")
    record.save()
    if once["bad"] or once["missing"] or len(figures["leases"]) != figures["jobs"]:
        sys.exit(f"NOT exactly once: {list(once['bad'].items())[:5]} missing {list(once['missing'])[:5]}")


if __name__ == "__main__":
    main()
