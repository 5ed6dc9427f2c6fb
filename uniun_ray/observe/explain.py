"""`uniun-ray explain JOB_ID`: one job's story from the event log.

"Why did my chat wait?" is answered by the log alone: when the job was queued and at
which tier, how its tier changed while it waited (a deadline passing, the foreground
moving), who held the device during each wait (and whether that holder was revoked for
it), each dispatch with its swap, the first token, every revoke with its reason, and how
it ended. On a pool of devices (SPEC §5) each run and each holder is named by its device. The log is replayed with the simulator's `Trace`, so tiers and runs mean here
exactly what they mean in the metrics and the timeline picture.
"""
from __future__ import annotations

import time
from typing import Iterable

from ..policy import tier_of
from ..events.trace import JobRecord, Run, Trace

#: Gaps shorter than this (the hand-over between a release and the next dispatch) are not
#: reported as idle device time; waits shorter than MIN_WAIT_S (a dispatch on arrival) not at all.
IDLE_EPSILON_S = 0.01
MIN_WAIT_S = 0.001


def explain(events: Iterable[dict], job_id: str) -> list[str]:
    """The story as lines of text. Raises KeyError when the log does not hold the job's
    submit (unknown id, or rotated out of the log)."""
    events = replayable(events)
    trace = Trace(events)
    rec = trace.jobs.get(job_id)
    if rec is None:
        raise KeyError(f"job {job_id!r} is not in the event log ({_span(trace)})")
    own = [e for e in events if e.get("job") == job_id]
    reasons = {(e["job"], e["t"]): (e.get("reason") or "revoked", e.get("cause")) for e in events if e["ev"] == "revoke"}
    return _Story(trace, rec, own, reasons).lines()


def replayable(events: Iterable[dict]) -> list[dict]:
    """The events a replay can use. Jobs whose submit was rotated out of the log are left
    out (a replay needs each job's fields). A run left open by a scheduler that died (the
    log is appended to across restarts) is closed with a failed finish at the next
    dispatch on its device's slot: at most one job holds a slot at a time (SPEC §6), so that
    dispatch proves it, or at a submit of the same id (a job id used again by a later
    scheduler: the story and the replay take the newest job of an id, and the old run must
    end before it is submitted, or its finish lands on a job that never ran)."""
    seen, kept, holders = set(), [], {}
    for ev in events:
        if ev["ev"] == "submit":
            seen.add(ev["job"])
            for device in [d for d, held in holders.items() if held["job"] == ev["job"]]:
                kept.append(_unfinished(holders.pop(device), ev["t"]))
        if "job" in ev and ev["job"] not in seen:
            continue
        device = (ev.get("device", "dev0"), ev.get("slot", 0))
        if ev["ev"] == "dispatch":
            if device in holders:
                kept.append(_unfinished(holders[device], ev["t"]))
            holders[device] = {k: ev[k] for k in ("job", "kind", "producer", "model")} | (
                {"device": ev["device"]} if "device" in ev else {})
        elif ev["ev"] == "finish":
            device = next((d for d, held in holders.items() if held["job"] == ev["job"]), None)
            if device is not None:
                del holders[device]
        kept.append(ev)
    return kept


def _unfinished(held: dict, t: float) -> dict:
    """The finish a run left open by a scheduler that died gets, at ``t``."""
    return held | {"t": t, "ev": "finish", "outcome": "failed", "reason": "no finish recorded: its scheduler was replaced"}


def _span(trace: Trace) -> str:
    if trace.start is None:
        return "the log is empty"
    return f"it spans {_clock(trace.start)} to {_clock(trace.end)}, {len(trace.jobs)} jobs"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


class _Story:
    def __init__(self, trace: Trace, rec: JobRecord, own: list[dict], reasons: dict) -> None:
        self.trace, self.rec, self.own, self.reasons = trace, rec, own, reasons
        self.dropped = next((e for e in own if e["ev"] == "drop"), None)
        self.out: list[str] = []

    def at(self, t: float, text: str) -> None:
        self.out.append(f"{t - self.rec.submit:+9.3f}s  {text}")

    def lines(self) -> list[str]:
        rec, job = self.rec, self.rec.job
        extras = [f"deadline {_clock(job.deadline)}"] if job.deadline is not None else []
        extras += [f"subject {job.subject}"] if job.subject else []
        extras += ["foreground hint"] if job.foreground_hint else []
        self.out.append(f"job {job.id}: {job.kind.value} from {job.producer}, model {job.model_id}"
                        + "".join(f", {x}" for x in extras))
        self.at(rec.submit, f"submitted at {_clock(rec.submit)}, queued at T{self.tier(rec.submit)}")
        ready = rec.submit
        for run in rec.runs:
            if run.start > ready:
                self.wait(ready, run.start)
            self.run(run)
            ready = run.end
        if rec.end is None and (not rec.runs or rec.runs[-1].outcome == "revoked"):
            until = self.dropped["t"] if self.dropped else self.trace.end
            if until > ready:
                self.wait(ready, until)
            if self.dropped:
                self.at(until, f"dropped: {self.dropped['reason']}")
            else:
                self.at(until, "still queued when the log ends")
        self.summary()
        return self.out

    def tier(self, t: float) -> int:
        return int(tier_of(self.rec.job, self.trace.foreground_at(t), t))

    def wait(self, a: float, b: float) -> None:
        """A queued stretch [a, b): its tier changes and who held the device, in time order."""
        if b - a < MIN_WAIT_S:
            return
        self.at(a, f"waited {b - a:.3f}s")
        notes = self.tier_changes(a, b)
        busy = 0.0
        for run in self.trace.runs:
            lo, hi = max(a, run.start), min(b, run.end)
            if hi <= lo or run.job == self.rec.job.id:
                continue
            busy += hi - lo
            note = ""
            if run.swap_s and run.start + run.swap_s > a:
                note += f", loading {run.model} ({run.swap_s:.3f}s)"
            if run.revoked_at is not None and run.revoked_at <= b:
                note += (f"; revoked at {run.revoked_at - self.rec.submit:+.3f}s ({self.revoke_reason(run)}), "
                         f"stopped {run.end - run.revoked_at:.3f}s later")
            notes.append((lo, f"  behind {run.job} ({run.kind} from {run.producer}, T{run.tier}, "
                              f"model {run.model}{self.on(run)}) for {hi - lo:.3f}s{note}"))
        if len(self.trace.devices) <= 1 and b - a - busy > IDLE_EPSILON_S:  # one device: idle or not
            notes.append((a, f"  device idle for {b - a - busy:.3f}s of it"))
        for t, text in sorted(notes, key=lambda n: n[0]):
            self.at(t, text)

    def tier_changes(self, a: float, b: float) -> list[tuple[float, str]]:
        """Where the job's tier moved within [a, b) (R1: a deadline, the foreground)."""
        notes = []
        pieces = list(self.trace.tier_pieces(self.rec, a, b))
        for (_, _, before), (lo, _, tier) in zip(pieces, pieces[1:]):
            if tier != before:
                why = "its deadline passed" if lo == self.rec.job.deadline else self.foreground(lo)
                notes.append((lo, f"  tier T{before} -> T{tier} ({why})"))
        return notes

    def foreground(self, t: float) -> str:
        fg = self.trace.foreground_at(t)
        front = fg.kind.value if fg.kind else "none"
        return f"foreground set to {front}" + (f" (subject {fg.subject})" if fg.subject else "")

    def on(self, run: Run) -> str:
        """Where a run ran, when the log is of a pool (one device needs no name)."""
        return f", device {run.device}" if len(self.trace.devices) > 1 else ""

    def revoke_reason(self, run: Run) -> str:
        return self.reasons.get((run.job, run.revoked_at), ("revoked", None))[0]

    def after_revoke(self, run: Run) -> str:
        """What became of the job after a revoked run: back in its queue, or over (its caller
        withdrew it: a client that went away; or a chat, which fails as preempted)."""
        if self.rec.end is None or self.rec.end > run.end:
            return "re-queued at its place (R6)"
        if self.reasons.get((run.job, run.revoked_at), (None, None))[1] == "cancel":
            return "withdrawn by its caller, not re-queued"
        return "ended"

    def beside(self, run: Run) -> str:
        """The slot a run took and the jobs already decoding there (SPEC §6), where it shared."""
        dispatch = next((e for e in self.own if e["ev"] == "dispatch" and e["t"] == run.start), {})
        batch = dispatch.get("batch", 1)
        return f" in slot {dispatch.get('slot', 0)}, beside {batch - 1} other job{'s' if batch > 2 else ''}" \
            if batch > 1 else ""

    def run(self, run: Run) -> None:
        """One hold of the device: dispatch (with its swap), tier changes, first token,
        revoke, reclaim, and how it ended, in time order."""
        swap = next((e for e in self.own if e["ev"] == "swap_start" and run.start <= e["t"] <= run.end), None)
        loaded = f", loading {run.model} over {swap['from'] or 'an empty device'} ({run.swap_s:.3f}s)" if swap else ""
        notes = [(run.start, f"dispatched at T{run.tier} on {run.model}{self.on(run)}{self.beside(run)}{loaded}")]
        notes += self.tier_changes(run.start, run.end)
        ft = self.rec.first_token
        if ft is not None and run.start <= ft <= run.end:
            notes.append((ft, f"first token (TTFT {ft - self.rec.submit:.3f}s)"))
        if run.revoked_at is not None:
            notes.append((run.revoked_at, f"revoked: {self.revoke_reason(run)}"))
        notes += [(ev["t"], f"lease reclaimed: {ev['reason']}") for ev in self.own
                  if ev["ev"] == "reclaim" and run.start <= ev["t"] <= run.end]
        if run.outcome is None:
            notes.append((run.end, f"still running when the log ends (held {run.held:.3f}s)"))
        elif run.outcome == "revoked":
            stopped = f"stopped {run.end - run.revoked_at:.3f}s after the revoke, " if run.revoked_at else ""
            notes.append((run.end, f"{stopped}held {run.held:.3f}s; {self.after_revoke(run)}"))
        else:
            why = next((f": {e['reason']}" for e in self.own if e["ev"] == "finish" and e["t"] == run.end
                        and e.get("reason")), "")
            notes.append((run.end, f"finished: {run.outcome}{why} (held {run.held:.3f}s)"))
        for t, text in sorted(notes, key=lambda n: n[0]):
            self.at(t, text)

    def summary(self) -> None:
        rec = self.rec
        held = sum(run.held for run in rec.runs)
        end = rec.end if rec.end is not None else self.dropped["t"] if self.dropped else self.trace.end
        revokes = sum(run.revoked_at is not None for run in rec.runs)
        ttft = f", TTFT {rec.first_token - rec.submit:.3f}s" if rec.first_token is not None else ""
        self.out.append(f"in all: {end - rec.submit:.3f}s from submit, {end - rec.submit - held:.3f}s waiting, "
                        f"{held:.3f}s holding the device over {len(rec.runs)} run(s), {revokes} revoke(s){ttft}")
