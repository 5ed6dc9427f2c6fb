"""`uniun-ray status`: the scheduler's snapshot and the event log's tail as one rich view.

It answers "who holds each device, why, and what waits behind it" at a glance: the loaded
model and the running job (kind, producer, tier, held time) of every device of the pool on
top (each named, with its engine, once there are two or more, and with its node's address
once the cluster has two or more nodes, which the summary lists with their devices), then
every tier's queue with its waits, the fair pool's vruntimes, the T2 budget, the foreground,
and the latest revokes, swaps and changes of the pool with their reasons. `render` is pure (a dict and a list in, a
renderable out), so `--watch` simply re-renders it, and tests and the screenshot in docs/observability.md
render it without a cluster.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..events.log import tail

#: Events the "recent" list shows: what changed who holds the device, or what it holds.
NOTABLE = ("revoke", "swap_end", "reclaim", "drop", "foreground", "device", "node")
TIER_STYLE = {"T0": "bold red", "T1": "bold magenta", "T2": "yellow", "T3": "cyan", "T4": "green"}


def render(snap: dict, events: list[dict] = (), *, now: float | None = None, per_tier: int = 6,
           recent: int = 8) -> Group:
    """The whole view. `now` defaults to the snapshot's time (the scheduler's clock, which
    the event times share); `per_tier` caps the rows shown per tier."""
    now = now if now is not None else snap.get("now") or time.time()
    parts = [_summary(snap, now), _running(snap), _queues(snap, now, per_tier), _pool(snap)]
    notable = [e for e in events if e["ev"] in NOTABLE][-recent:]
    if notable:
        parts.append(_recent(notable, now))
    return Group(*parts)


def _summary(snap: dict, now: float) -> Table:
    fg, t2 = snap["foreground"], snap["t2"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")  # the event log's path must stay whole to be copied
    grid.add_column(style="bold")
    grid.add_column()
    foreground = (fg["kind"] or "none") + (f" ({fg['subject']})" if fg["subject"] else "")
    devices = snap.get("devices") or []
    if len(devices) > 1:
        grid.add_row("loaded models", ", ".join(f"{d['device']} {d['loaded_model'] or 'none'}{_calls(d)}"
                                                for d in devices), "foreground (T1)", foreground)
    else:
        grid.add_row("loaded model", str(snap["loaded_model"] or "none") + (_calls(devices[0]) if devices else ""),
                     "foreground (T1)", foreground)
    if snap.get("chat_model"):
        grid.add_row("chat model", snap["chat_model"], "", "")
    if len(snap.get("nodes") or []) > 1:
        grid.add_row("nodes", "; ".join(f"{n['address']}{' (head)' if n['head'] else ''}: "
                                        f"{' '.join(n['devices']) or 'no device'}" for n in snap["nodes"]), "", "")
    budget = Text(f"{_bar(t2['share'] / t2['limit'] if t2['limit'] else 0)} {t2['share']:.0%} of {t2['limit']:.0%}")
    if t2["over_budget"]:
        budget.append("  over budget: T2 yields to waiting T3/T4", style="bold yellow")
    wake = snap.get("next_wakeup")
    grid.add_row("queued", str(snap["queued"]), "T2 budget used", budget)
    grid.add_row("swaps", _swaps(snap, devices), "next wake-up", f"in {wake - now:.1f}s" if wake else "-")
    if snap.get("event_log"):
        grid.add_row("event log", snap["event_log"], "", "")
    if snap.get("settings"):
        grid.add_row("settings", _settings(snap["settings"]), "", "")
    for device in devices:
        plan = (device.get("engine") or {}).get("memory")
        if plan:
            grid.add_row(f"memory {device['device']}", memory_line(plan), "", "")
    niceness = max([(d.get("engine") or {}).get("niceness", 0) for d in devices] or [0])
    if niceness > 0:
        grid.add_row("CPU priority", Text(f"model actors at niceness {niceness}: the host's other busy programs come "
                                          "first (start Ray with RAY_worker_niceness=0)", style="bold yellow"), "", "")
    return grid


def _swaps(snap: dict, devices: list[dict]) -> str:
    """Each device's last swap (its kind and time) and the models it keeps resident or warm;
    else the measured times per model."""
    lines = []
    for device in devices:
        last = (device.get("swaps") or {}).get("last")
        if last:
            kept = ", ".join(f"{m} {where}" for m, where in last["kept"].items())
            name = f"{device['device']}: " if len(devices) > 1 else ""
            lines.append(f"{name}{last['model']} {last['kind']} {last['seconds']:.3f}s" + (f" (kept: {kept})" if kept else ""))
    return "; ".join(lines) or ", ".join(f"{m} {s:.1f}s" for m, s in sorted(snap.get("swap_s", {}).items())) or "-"
def _settings(rows: list[dict]) -> str:
    """The settings not at their default, and where each came from (`--json` lists them all)."""
    changed = [f"{row['setting']}={row['value']} ({row['source']})" for row in rows if row["source"] != "default"]
    return ", ".join(changed) or "all defaults"


def memory_line(plan: dict) -> str:
    """A device's memory plan: each part used of planned, in MB (parts planned at 0 left out)."""
    parts = [f"{name} {'-' if part['used_mb'] is None else format(part['used_mb'], 'g')}/{part['planned_mb']:g}"
             for name, part in plan["parts"].items() if part["planned_mb"] or part["used_mb"]]
    return f"budget {plan['budget_mb']:g} MB: " + ", ".join(parts)


def _calls(device: dict) -> str:
    """The loaded model's tool-call format, where its template takes tools."""
    calls = (device.get("engine") or {}).get("tool_call_format")
    return f" (tool calls: {calls})" if calls else ""


def _bar(fraction: float, width: int = 10) -> str:
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "█" * filled + "░" * (width - filled)


def _running(snap: dict) -> Text:
    """What each device runs: a line, or with several slots (SPEC §6) a head line saying how
    many are busy and a line per slot's job. With one device, the device needs no name."""
    devices = snap.get("devices") or [{"running": snap["running"]}]
    nodes = snap.get("nodes") or []
    addresses = {n["node"]: n["address"] for n in nodes} if len(nodes) > 1 else {}
    lines = []
    for device in devices:
        head = Text("▶ ") if len(devices) == 1 else _device_head(device, addresses)
        if device.get("slots", 1) == 1:
            lines.append(_holder(snap, device["running"], head))
            continue
        jobs = device["jobs"]
        how = " (auto, measured at load)" if device.get("slots_auto") else ""
        lines.append(head.append(f"{len(jobs)} of {device['slots']} slots busy{how}", style="bold"))
        lines += [_holder(snap, job, Text(f"   slot {job['slot']}  ")) for job in jobs]
    return Text("\n").join(lines)


def _device_head(device: dict, addresses: dict[str, str]) -> Text:
    """The device's name, model and engine; its node's address where the cluster has several."""
    engine = device.get("engine") or {}
    how = " ".join(str(engine[k]) for k in ("device", "dtype") if engine.get(k))
    node = addresses.get(device.get("node"))
    return Text(f"▶ {device['device']} [{device['loaded_model'] or 'empty'}{', ' + how if how else ''}]"
                f"{' on ' + node if node else ''} ", style="bold")


def _holder(snap: dict, job: dict | None, text: Text) -> Text:
    if job is None:
        return text.append("device idle", style="dim")
    lease = snap.get("leases", {}).get(job["id"], {})
    text.append(f"{job['tier']} {job['kind']}", style=TIER_STYLE.get(job["tier"], ""))
    text.append(f"  producer {job['producer']}  model {job['model']}  held {job['held_s']:.1f}s  job {job['id']}")
    if lease.get("state") == "loading":
        text.append("  (loading the model)", style="cyan")
    if job.get("revoked"):
        text.append("  revoked: stopping at the next step", style="bold yellow")
    return text


def _queues(snap: dict, now: float, per_tier: int) -> Table:
    table = Table("tier", "#", "kind", "producer", "model", "waited", "deadline", "subject", "job",
                  title="queues (served strictly in tier order; FIFO, EDF in T3, fair pool in T4)",
                  title_justify="left")
    for tier, queued in snap["tiers"].items():
        style = TIER_STYLE.get(tier, "")
        if not queued:
            table.add_row(Text(tier, style=style), "0", *[""] * 7, style="dim")
            continue
        for i, job in enumerate(queued[:per_tier]):
            table.add_row(Text(tier, style=style) if i == 0 else "", str(len(queued)) if i == 0 else "",
                          *_job_cells(job, now))
        if len(queued) > per_tier:
            longest = max(job["waited_s"] for job in queued)
            table.add_row("", "", f"… {len(queued) - per_tier} more", "", "", f"≤ {longest:.1f}s", "", "", "",
                          style="dim")
    return table


def _job_cells(job: dict, now: float) -> list[str]:
    deadline = job["deadline"]
    due = "-" if deadline is None else (f"in {deadline - now:.1f}s" if deadline > now else f"{now - deadline:.1f}s ago")
    subject = (job["subject"] or "") + (" (hint)" if job["foreground_hint"] else "")
    return [job["kind"], str(job["producer"]), job["model"], f"{job['waited_s']:.1f}s", due, subject, job["id"]]


def _pool(snap: dict) -> Table:
    table = Table("kind", "vruntime", "producers (vruntime)", title="fair pool (T4): lowest vruntime runs next",
                  title_justify="left")
    producers = snap["vruntime"].get("producers", {})
    for kind, value in snap["vruntime"].get("kinds", {}).items():
        flows = ", ".join(f"{p} {v:.2f}" for p, v in producers.get(kind, {}).items())
        table.add_row(kind, f"{value:.2f}", flows)
    return table


def _recent(events: list[dict], now: float) -> Table:
    table = Table("when", "event", "detail", title="recent revokes, swaps, foreground and pool changes",
                  title_justify="left")
    for ev in reversed(events):
        table.add_row(f"{max(0.0, now - ev['t']):.1f}s ago", ev["ev"], Text(describe(ev)))  # text, not markup
    return table


def describe(ev: dict) -> str:
    """One notable event in a line; a run's event ends with its device, in brackets."""
    if ev["ev"] in ("device", "node"):
        what = ev["device"] if ev["ev"] == "device" else f"node {ev['address']} ({ev['node'][:8]})"
        return f"{what} {ev['change']}" + (f": {ev['reason']}" if ev.get("reason") else "")
    if ev["ev"] == "foreground":
        return (ev["kind"] or "none") + (f" ({ev['subject']})" if ev.get("subject") else "")
    job = f"{ev.get('job')} ({ev.get('producer')})"
    if ev["ev"] == "revoke":
        text = f"{job}: {ev.get('reason') or 'revoked'}"
    elif ev["ev"] == "swap_end":
        text = (f"gave up loading {ev['model']} for a chat (R13), for {job}" if ev.get("abandoned") else
                f"loaded {ev['model']} ({ev.get('swap_kind', 'cold')}) in {ev.get('seconds', 0.0):.3f}s for {job}")
    else:
        text = f"{job}: {ev.get('reason', '')}"
    return text + (f" [{ev['device']}]" if ev.get("device") else "")


# -- the shell: fetch and re-render ------------------------------------------------------
def fetch(status: Callable[[], dict]) -> tuple[dict, list[dict]]:
    """The snapshot, and the tail of the event log it names when that file is on this
    machine (the usual case: the scheduler runs on the head; elsewhere the view has no
    "recent" list, and `explain --log` takes a copied log)."""
    snap = status()
    path = snap.get("event_log")
    return snap, tail(path) if path and Path(path).exists() else []


def watch(status: Callable[[], dict], interval_s: float = 1.0, console: Console | None = None) -> None:
    """Re-render every `interval_s` until interrupted (Ctrl-C raises KeyboardInterrupt)."""
    with Live(render(*fetch(status)), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval_s)
            live.update(render(*fetch(status)), refresh=True)
