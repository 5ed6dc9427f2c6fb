"""Where a device's time went in one run of uniun-ray: the event log's story of who held the
device, and the decode loop's own counters of what it computed meanwhile.

From the event log (`uniun_ray.events.schema`), per device, every instant of the window is in
one state: swapping; a chat alone; a chat beside k other jobs; b background jobs; idle while a
job waits in the queue (the scheduler's gap); idle. A job counts from its dispatch until its
revoke or finish (a revoked row stops at the next step). The revokes are counted by cause, with
what they cost: a revoked background job's time out of its slot until it re-joins (its next
dispatch), and the revoke's stop (revoke to finish). The ModelActor's process CPU seconds over
the window (`process_cpu_s`) against the threads it was given say how much of its cores it used.

From the engine's counters, taken before and after the window (`status()`: `steps_by_batch`,
`step_s_by_batch`), the steps the decode loop took at each batch size and their seconds (0
rows: steps that only read a prompt); the time jobs held the device less those seconds is the
loop idle while there was work: waiting for a job's start, its stream, the scheduler.

    account(events, start, end, engine_before, engine_after) -> dict    # pure: tests feed a log
"""
from __future__ import annotations

from collections import Counter, defaultdict

SWAP, IDLE, WAITING = "swap", "idle", "idle, a job queued"


def state(live: dict[str, str], swapping: bool, queued: int) -> str:
    """The name of one device's state: `live` maps its running jobs to their kinds."""
    if swapping:
        return SWAP
    chats = sum(kind == "chat" for kind in live.values())
    others = len(live) - chats
    if chats:
        return "chat alone" if not others else f"chat beside {others}"
    if others:
        return f"background at {others}"
    return WAITING if queued else IDLE


def timeline(events: list[dict], start: float, end: float) -> dict[str, Counter]:
    """Seconds per state per device within [start, end], replaying the whole log for the
    state at `start`."""
    live: dict[str, dict[str, str]] = defaultdict(dict)     # device -> job -> kind
    swapping: dict[str, bool] = defaultdict(bool)
    queued: set[str] = set()
    seconds: dict[str, Counter] = defaultdict(Counter)
    devices = {ev.get("device", "dev0") for ev in events if "device" in ev or ev["ev"] == "dispatch"} or {"dev0"}
    at = start

    def advance(to: float) -> None:
        nonlocal at
        to = min(max(to, start), end)
        if to > at:
            for device in devices:
                seconds[device][state(live[device], swapping[device], len(queued))] += to - at
            at = to

    for ev in events:
        advance(ev["t"])
        kind, job, device = ev["ev"], ev.get("job"), ev.get("device", "dev0")
        if kind == "submit":
            queued.add(job)
        elif kind == "dispatch":
            queued.discard(job)
            live[device][job] = ev["kind"]
        elif kind == "swap_start":
            swapping[device] = True
        elif kind == "swap_end":
            swapping[device] = False
        elif kind == "revoke":
            live[device].pop(job, None)
        elif kind == "finish":
            live[device].pop(job, None)
            if ev.get("requeued", ev.get("outcome") == "revoked" and ev["kind"] != "chat"):
                queued.add(job)
        elif kind == "drop":
            queued.discard(job)
    advance(end)
    return {device: seconds[device] for device in sorted(devices)}


def revokes(events: list[dict], start: float, end: float) -> dict:
    """The revokes within the window by cause; re-joins (a revoked job dispatched again); and
    their cost: background seconds out of a slot (revoke to next dispatch, or the window's end)
    and the stops (revoke to finish)."""
    causes, out, stops, rejoined, bounded = Counter(), 0.0, [], 0, []
    revoked: dict[str, float] = {}    # background job -> its revoke's time, until it re-joins
    stopping: dict[str, float] = {}   # job -> its revoke's time, until it finishes
    for ev in events:
        if ev["ev"] == "revoke" and start <= ev["t"] <= end:
            causes[ev.get("cause", "?")] += 1
            stopping[ev["job"]] = ev["t"]
            if "bound_s" in ev:
                bounded.append(ev)
            if ev["kind"] != "chat":
                revoked[ev["job"]] = ev["t"]
        elif ev["ev"] == "finish" and ev["job"] in stopping:
            stops.append(ev["t"] - stopping.pop(ev["job"]))
        elif ev["ev"] == "dispatch" and ev["job"] in revoked:
            out += min(ev["t"], end) - revoked.pop(ev["job"])
            rejoined += 1
    out += sum(end - t for t in revoked.values())
    return {"by_cause": dict(causes), "rejoined": rejoined, "background_out_s": out, "step_bound": _bound(bounded),
            "stop_s_mean": sum(stops) / len(stops) if stops else None}


def _bound(revokes: list[dict]) -> dict | None:
    """R23 as the policy read it at its revokes "step": the bounds it kept (least, most) and the
    step profile at the last of them."""
    if not revokes:
        return None
    bounds = [ev["bound_s"] for ev in revokes]
    return {"least_s": min(bounds), "most_s": max(bounds), "step_profile": revokes[-1].get("step_profile")}


def engine_steps(before: dict | None, after: dict | None) -> dict[int, tuple[int, float, float | None]]:
    """Per batch size (0: prompt reading only), the decode loop's steps, their seconds and the
    stepping thread's CPU seconds in them (None: an engine that does not count them) between
    two `status()` of the engine (JSON's string keys read as ints)."""
    if not before or not after:
        return {}

    def change(key: str) -> dict[int, float]:
        old = {int(rows): value for rows, value in (before.get(key) or {}).items()}
        new = {int(rows): value for rows, value in (after.get(key) or {}).items()}
        return {rows: value - old.get(rows, 0) for rows, value in new.items() if value != old.get(rows, 0)}
    counts, spent = change("steps_by_batch"), change("step_s_by_batch")
    cpu = change("step_cpu_s_by_batch") if "step_cpu_s_by_batch" in after else None
    return {rows: (int(counts.get(rows, 0)), spent.get(rows, 0.0), None if cpu is None else cpu.get(rows, 0.0))
            for rows in sorted(set(counts) | set(spent))}


def account(events: list[dict], start: float, end: float, engine_before: dict | None = None,
            engine_after: dict | None = None) -> dict:
    """The device's time in the window by state, the revokes and their cost, and the engine's
    steps; `held_s` (any job running) against `stepping_s` (the loop computing) gives the loop's
    idle while there was work (one device: the engine's counters are that device's)."""
    states = timeline(sorted(events, key=lambda ev: ev["t"]), start, end)
    steps = engine_steps(engine_before, engine_after)
    held = sum(s for by_state in states.values() for name, s in by_state.items() if name not in (IDLE, WAITING, SWAP))
    stepping = sum(s for _, s, _ in steps.values())
    cpu = (engine_after["process_cpu_s"] - engine_before["process_cpu_s"]
           if engine_before and engine_after and "process_cpu_s" in engine_before and "process_cpu_s" in engine_after
           else None)
    return {"window_s": end - start, "states": states, "revokes": revokes(events, start, end), "steps": steps,
            "held_s": held, "stepping_s": stepping if steps else None,
            "loop_idle_while_held_s": held - stepping if steps else None,
            "cpu_s": cpu, "threads": (engine_after or {}).get("threads")}


def _steps(rows: int, n: int, seconds: float, cpu: float | None, share) -> str:
    if not n:
        return f"{rows}: {share(seconds)}"
    off = "" if cpu is None else f" ({(seconds - cpu) / n * 1e3:.0f} off a core)"
    return f"{rows}: {share(seconds)}, {n}, {seconds / n * 1e3:.0f}{off}"


def rows(accounted: dict) -> list[tuple[str, str]]:
    """The account as (figure, measured) rows for a record: seconds and share of the window."""
    window = accounted["window_s"]

    def share(seconds: float) -> str:
        return f"{seconds:.1f} s ({seconds / window:.0%})"
    out = []
    for device, by_state in accounted["states"].items():
        out.append((f"{device}: time by state", "; ".join(f"{name} {share(s)}" for name, s in
                                                         sorted(by_state.items(), key=lambda item: -item[1]))))
    if accounted["steps"]:
        out.append(("decode loop: steps by batch size (0: prompt only): seconds, steps, ms a step"
                    " (of which off a core: the stepping thread waiting for the GIL or a core)",
                    "; ".join(_steps(rows, n, s, cpu, share) for rows, (n, s, cpu) in accounted["steps"].items())))
        out.append(("decode loop: held by jobs / stepping / idle while held",
                    f"{share(accounted['held_s'])} / {share(accounted['stepping_s'])} / "
                    f"{share(accounted['loop_idle_while_held_s'])}"))
    if accounted["cpu_s"] is not None:
        out.append(("model actor: CPU seconds; cores used on average; threads given",
                    f"{accounted['cpu_s']:.1f} s; {accounted['cpu_s'] / window:.2f}; {accounted['threads']}"))
    r = accounted["revokes"]
    stop = "–" if r["stop_s_mean"] is None else f"{r['stop_s_mean'] * 1e3:.0f} ms"
    causes = dict(sorted(r["by_cause"].items())) or "none"
    out.append(("revokes by cause; re-joins; background seconds out of a slot; mean stop",
                f"{causes}; {r['rejoined']}; {r['background_out_s']:.1f} s; {stop}"))
    if r.get("step_bound"):
        bound = r["step_bound"]
        profile = ", ".join(f"{rows}: {s * 1e3:.0f}" for rows, s in (bound["step_profile"] or {}).items())
        out.append(("R23 at the revokes it caused: a chat's step bound, least / most; the step profile read "
                    "at the last (rows: ms)", f"{bound['least_s'] * 1e3:.0f} / {bound['most_s'] * 1e3:.0f} ms; {profile}"))
    return out
