"""Observability without Ray (issue 5): `explain` and the status view are pure functions of
a log and a snapshot; the scheduler feeds its metrics sink every event it logs; the log's
tail reads across a rotation."""
from __future__ import annotations

import asyncio
import json
import re
import time

from rich.console import Console
from conftest import FakeDevice, ManualClock, lease_of, spec

from uniun_ray.observe.explain import explain, replayable
from uniun_ray.observe.statusview import render
from uniun_ray.events.log import EventLog, read, tail
from uniun_ray.runtime.service import RuntimeConfig, SchedulerService


def job(t, ev, job_id, kind, producer=None, model="m", **fields):
    return {"t": t, "ev": ev, "job": job_id, "kind": kind, "producer": producer or kind, "model": model} | fields


def submit(t, job_id, kind, producer=None, model="m", deadline=None, hint=False, subject=None):
    return job(t, "submit", job_id, kind, producer, model, deadline=deadline, foreground_hint=hint, subject=subject)


#: A nataraj holds the device; chat c1 arrives and revokes it, chat c2 waits behind c1; a gana
#: falls due while it waits; the nataraj resumes last.
LOG = [
    submit(100.0, "n1", "nataraj", "nataraj:deck"),
    job(100.0, "dispatch", "n1", "nataraj", "nataraj:deck", swap=True, tier=4),
    job(100.0, "swap_start", "n1", "nataraj", "nataraj:deck", **{"from": None}),
    job(101.0, "swap_end", "n1", "nataraj", "nataraj:deck", seconds=1.0),
    submit(102.0, "g1", "gana", "gana:cron", deadline=103.0),
    submit(104.0, "c1", "chat"),
    job(104.0, "revoke", "n1", "nataraj", "nataraj:deck", reason="arrival of chat job c1"),
    job(104.05, "finish", "n1", "nataraj", "nataraj:deck", outcome="revoked", requeued=True),
    job(104.05, "dispatch", "c1", "chat", swap=False, tier=0),
    job(104.25, "first_token", "c1", "chat"),
    submit(104.5, "c2", "chat"),
    job(106.0, "finish", "c1", "chat", outcome="done"),
    job(106.0, "dispatch", "c2", "chat", swap=False, tier=0),
    job(106.1, "first_token", "c2", "chat"),
    job(107.0, "finish", "c2", "chat", outcome="done"),
    job(107.0, "dispatch", "g1", "gana", "gana:cron", swap=False, tier=3),
    job(108.0, "finish", "g1", "gana", "gana:cron", outcome="done"),
    job(108.0, "dispatch", "n1", "nataraj", "nataraj:deck", swap=False, tier=4),
    job(109.0, "finish", "n1", "nataraj", "nataraj:deck", outcome="done"),
]


def story(events, job_id) -> str:
    return "\n".join(explain(events, job_id))


def test_explain_names_who_a_waiting_chat_waited_behind():
    text = story(LOG, "c2")
    assert "queued at T0" in text and "waited 1.500s" in text
    assert "behind c1 (chat from chat, T0, model m) for 1.500s" in text
    assert "first token (TTFT 1.600s)" in text and "finished: done" in text


def test_explain_shows_the_revoke_that_made_way_for_a_chat():
    text = story(LOG, "c1")
    assert re.search(r"behind n1 \(nataraj from nataraj:deck, T4, model m\) for 0\.050s; revoked at \+0\.000s "
                     r"\(arrival of chat job c1\), stopped 0\.050s later", text), text


def test_explain_tells_a_preempted_jobs_story_with_tier_changes():
    text = story(LOG, "n1")
    assert "dispatched at T4 on m, loading m over an empty device (1.000s)" in text
    assert "revoked: arrival of chat job c1" in text and "re-queued at its place (R6)" in text
    assert [line.split("behind ")[1].split(" ")[0] for line in text.splitlines() if "behind" in line] == \
        ["c1", "c2", "g1"]
    gana = story(LOG, "g1")
    assert "queued at T4" in gana and "tier T4 -> T3 (its deadline passed)" in gana
    assert "dispatched at T3" in gana


def test_explain_a_dropped_job_and_an_unknown_one():
    events = LOG[:6] + [job(104.5, "drop", "g1", "gana", "gana:cron", reason="cancelled by its caller")]
    text = story(events, "g1")
    assert "dropped: cancelled by its caller" in text and "waited 2.500s" in text
    try:
        explain(events, "nope")
    except KeyError as error:
        assert "not in the event log" in str(error)
    else:
        raise AssertionError("an unknown job must raise")


def test_replay_closes_a_run_its_dead_scheduler_left_open():
    """A scheduler killed mid-run never logs that run's finish; the next scheduler's first
    dispatch ends it, so the dead run is not shown as holding the device forever."""
    events = [submit(1.0, "old", "nataraj"), job(1.0, "dispatch", "old", "nataraj", swap=False, tier=4),
              submit(5.0, "c", "chat"), job(5.0, "dispatch", "c", "chat", swap=False, tier=0),
              job(6.0, "finish", "c", "chat", outcome="done"),
              job(7.0, "dispatch", "orphan", "gana", swap=False, tier=4)]  # its submit was rotated out
    repaired = replayable(events)
    assert [(e["ev"], e["job"], e["t"]) for e in repaired if e["ev"] == "finish"] == [("finish", "old", 5.0),
                                                                                     ("finish", "c", 6.0)]
    assert "orphan" not in {e.get("job") for e in repaired}
    assert "its scheduler was replaced" in story(events, "old")
    assert "behind" not in story(events, "c")


def test_replay_ends_a_dead_schedulers_run_before_its_id_is_submitted_again():
    """A later scheduler (a test's, a restarted one) submits a job of the id a dead one left
    running: the old run ends at that submit, so the finish never lands on the new job, which
    has not run yet (the replay raised IndexError, and `/v1/explain` answered 500)."""
    events = [submit(1.0, "n", "nataraj"), job(1.0, "dispatch", "n", "nataraj", swap=False, tier=4),
              submit(3.0, "n", "nataraj"), submit(4.0, "c", "chat"),
              job(4.0, "dispatch", "c", "chat", swap=False, tier=0), job(5.0, "finish", "c", "chat", outcome="done"),
              job(5.0, "dispatch", "n", "nataraj", swap=False, tier=4), job(6.0, "finish", "n", "nataraj", outcome="done")]
    repaired = replayable(events)
    assert [(e["ev"], e["job"], e["t"]) for e in repaired if e["ev"] in ("finish", "submit") and e["job"] == "n"] == \
        [("submit", "n", 1.0), ("finish", "n", 3.0), ("submit", "n", 3.0), ("finish", "n", 6.0)]
    text = story(events, "n")
    assert "finished: done" in text and "behind c" in text


def test_status_view_shows_each_queued_job_in_its_tier(tmp_path):
    async def go():
        s = SchedulerService(FakeDevice(), RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        await s.submit(spec("hold", "nataraj", producer="nataraj:deck"))
        await lease_of(s, "hold")
        await s.set_foreground("extract", "note-17")
        await s.submit(spec("x-open", "extract", subject="note-17"))
        await s.submit(spec("x-fill", "extract"))
        await s.submit(spec("g-due", "gana", producer="gana:cron", deadline=time.time() - 1))
        await s.submit(spec("n-next", "nataraj", producer="nataraj:deck"))
        return await s.status()
    snap = asyncio.run(asyncio.wait_for(go(), 10))
    console = Console(record=True, width=200)
    console.print(render(snap, read(tmp_path / "ev.jsonl")))
    text = console.export_text()
    for tier, job_id in (("T1", "x-open"), ("T2", "x-fill"), ("T3", "g-due"), ("T4", "n-next")):
        assert re.search(rf"│ {tier} +│ 1 +│ .*{job_id}", text), (tier, job_id, text)
    assert re.search(r"▶ T4 nataraj +producer nataraj:deck +model m +held \d+\.\ds +job hold", text)
    assert "foreground (T1)  extract (note-17)" in text
    assert "revoke" in text and "hold (nataraj:deck): arrival of extract job x-open" in text
    assert str(tmp_path / "ev.jsonl") in text


def test_status_view_shows_each_slot_of_a_device_and_its_job():
    async def go():
        s = SchedulerService(FakeDevice(), RuntimeConfig(slots=3))
        for i in range(2):
            await s.submit(spec(f"n{i}", "nataraj", producer=f"nataraj:{i}"))
            await lease_of(s, f"n{i}")
        return await s.status()
    snap = asyncio.run(asyncio.wait_for(go(), 10))
    console = Console(record=True, width=200)
    console.print(render(snap))
    text = console.export_text()
    assert "2 of 3 slots busy" in text
    for i in range(2):
        assert re.search(rf"slot {i}  T4 nataraj +producer nataraj:{i} .* job n{i}", text), text
    snap["devices"][0]["engine"] = {"tool_call_format": "hermes"}
    console.print(render(snap))
    assert re.search(r"loaded model +m \(tool calls: hermes\)", console.export_text())   # its template's format


def test_explain_names_the_slot_and_the_jobs_beside_and_replay_keeps_slot_mates_open(tmp_path):
    async def go():
        s = SchedulerService(FakeDevice(), RuntimeConfig(slots=3, event_log=str(tmp_path / "ev.jsonl")))
        for i in range(2):
            await s.submit(spec(f"n{i}", "nataraj", producer=f"nataraj:{i}"))
            await lease_of(s, f"n{i}")
    asyncio.run(asyncio.wait_for(go(), 10))
    events = read(tmp_path / "ev.jsonl")
    assert "in slot 1, beside 1 other job" in story(events, "n1")
    assert "beside" not in story(events, "n0")
    assert not [e for e in replayable(events) if e["ev"] == "finish"]   # two slots, two open runs: no one closed


def test_status_view_caps_long_queues_and_marks_the_t2_budget():
    snap = {"now": 10.0, "loaded_model": None, "foreground": {"kind": None, "subject": None}, "running": None,
            "queued": 9, "vruntime": {"kinds": {}, "producers": {}}, "next_wakeup": None,
            "t2": {"share": 0.7, "limit": 0.6, "over_budget": True},
            "tiers": {"T0": [], "T1": [], "T2": [], "T3": [],
                      "T4": [{"id": f"n{i}", "kind": "nataraj", "producer": "nataraj", "model": "m",
                              "deadline": None, "subject": None, "foreground_hint": False, "waited_s": 9.0 - i}
                             for i in range(9)]}}
    console = Console(record=True, width=160)
    console.print(render(snap, per_tier=3))
    text = console.export_text()
    assert "n2" in text and "n3" not in text and "… 6 more" in text and "≤ 9.0s" in text
    assert "device idle" in text and "70% of 60%" in text and "over budget" in text


def test_the_scheduler_feeds_its_metrics_sink_every_logged_event(tmp_path):
    class Sink:
        def __init__(self):
            self.events, self.snapshots = [], []

        def write(self, event):
            self.events.append(event)

        def refresh(self, snapshot):
            self.snapshots.append(snapshot())

    sink = Sink()

    async def go():
        clock = ManualClock()
        s = SchedulerService(FakeDevice(), RuntimeConfig(event_log=str(tmp_path / "ev.jsonl"), reap_period_s=0.02),
                             metrics=sink, clock=clock)
        await s.submit(spec("n", "nataraj"))
        lease = await lease_of(s, "n")
        await clock.advance(0.1)  # the timer refreshes the gauges
        await s.release("n", lease.epoch, "done")
    asyncio.run(asyncio.wait_for(go(), 10))
    assert sink.events == read(tmp_path / "ev.jsonl")
    assert sink.snapshots and sink.snapshots[0]["running"]["id"] == "n"


def test_revoke_events_carry_the_policys_cause_and_finish_says_requeued(tmp_path):
    """The log's (and the metrics') revoke cause is the policy's RevokeCause, not parsed
    from text; `requeued` is the policy's Requeued, not "a chat is never re-queued"."""
    from uniun_ray.events.log import read

    async def go():
        clock = ManualClock()
        s = SchedulerService(FakeDevice(), RuntimeConfig(event_log=str(tmp_path / "ev.jsonl"), lease_timeout_s=0.3,
                                                         waiter_timeout_s=5.0, reap_period_s=0.05), clock=clock)
        await s.submit(spec("n", "nataraj"))
        n = await lease_of(s, "n")
        await s.submit(spec("c", "chat"))                        # arrival
        assert await s.release("n", n.epoch, "revoked") is True
        c = await lease_of(s, "c")
        await s.release("c", c.epoch, "done")
        await lease_of(s, "n")
        await s.cancel("n")                                      # cancel
        await s.submit(spec("g", "gana"))
        await lease_of(s, "g")                                   # never renewed: reclaim
        await clock.advance(0.35)
        assert not s.leases.jobs
    asyncio.run(asyncio.wait_for(go(), 10))
    events = read(tmp_path / "ev.jsonl")
    assert [(e["job"], e["cause"]) for e in events if e["ev"] == "revoke"] == \
        [("n", "arrival"), ("n", "cancel"), ("g", "reclaim")]
    assert [(e["job"], e["outcome"], e["requeued"]) for e in events if e["ev"] == "finish"] == \
        [("n", "revoked", True), ("c", "done", False), ("n", "revoked", False), ("g", "revoked", False)]


def test_tail_reads_the_newest_events_across_a_rotation(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=3_000, backups=5)
    for i in range(200):
        log.write({"t": float(i), "ev": "foreground", "kind": None, "subject": None})
    log.close()
    with open(path, "a") as f:
        f.write('{"t": 200.0, "ev": "fore')  # a line being written
    current = path.read_text().count("\n")  # complete lines in the file being written
    times = [e["t"] for e in tail(path, max_bytes=4_000)]
    assert times == [float(i) for i in range(int(times[0]), 200)]
    assert current < len(times) < 200           # it reached into the backup, not the whole history
    assert all(e["ev"] == "foreground" for e in tail(path, max_bytes=100))  # a cut first line is skipped


def test_the_grafana_dashboard_charts_every_metric_and_only_those():
    from pathlib import Path

    import uniun_ray.runtime.metrics as metrics

    root = Path(__file__).parent.parent
    defined = set(re.findall(r'"(uniun_\w+)"', Path(metrics.__file__).read_text()))
    dashboard = json.loads((root / "observability" / "grafana_uniun.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    charted = {re.sub(r"_(bucket|count|sum)$", "", name) for e in exprs for name in re.findall(r"ray_(uniun_\w+)", e)}
    assert charted == defined


def test_metrics_time_each_wait_from_submit_or_requeue_and_ttft_from_submit():
    from uniun_ray.runtime.metrics import SchedulerMetrics

    class Recorder:
        def __init__(self):
            self.seen = []

        def observe(self, value, tags):
            self.seen.append((tags["kind"], round(value, 3)))

    m = SchedulerMetrics()
    m.wait, m.ttft = Recorder(), Recorder()
    for event in LOG:
        m.write(event)
    assert m.wait.seen == [("nataraj", 0.0), ("chat", 0.05), ("chat", 1.5), ("gana", 5.0), ("nataraj", 3.95)]
    assert m.ttft.seen == [("chat", 0.25), ("chat", 1.6)]
    assert not m._submitted and not m._queued_since  # every job ended: nothing kept


def test_cli_explain_reads_a_log_offline(tmp_path, capsys):
    from uniun_ray import cli

    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in LOG))
    assert cli.main(["explain", "c2", "--log", str(path)]) == 0
    assert "behind c1 (chat from chat, T0, model m)" in capsys.readouterr().out
    assert cli.main(["explain", "nope", "--log", str(path)]) == 2
    assert "not in the event log" in capsys.readouterr().err
    assert cli.main(["explain", "c2", "--log", str(tmp_path / "missing.jsonl")]) == 1


def test_cli_status_watch_redraws_until_ctrl_c(monkeypatch, tmp_path):
    import uniun_ray
    from uniun_ray import cli

    async def go():
        s = SchedulerService(FakeDevice(), RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        await s.submit(spec("n", "nataraj"))
        return await s.status()
    snap = asyncio.run(asyncio.wait_for(go(), 10))
    calls = []

    def status():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return snap
    monkeypatch.setattr(cli, "_connect", lambda args: None)
    monkeypatch.setattr(uniun_ray, "status", status)
    assert cli.main(["status", "--watch", "--interval", "0"]) == 0
    assert len(calls) == 3


def test_explain_shows_a_tier_change_while_the_job_runs():
    events = [submit(0.0, "n", "nataraj"), job(0.0, "dispatch", "n", "nataraj", swap=False, tier=4),
              {"t": 1.0, "ev": "foreground", "kind": "nataraj", "subject": None},
              job(2.0, "finish", "n", "nataraj", outcome="done")]
    assert "   +1.000s    tier T4 -> T1 (foreground set to nataraj)" in story(events, "n").splitlines()


def test_metrics_name_the_device_of_what_they_count_and_of_each_gauge(tmp_path):
    from uniun_ray.runtime.metrics import SchedulerMetrics

    class Recorder:
        def __init__(self):
            self.seen = {}

        def set(self, value, tags=None):
            self.seen[tuple(sorted((tags or {}).items()))] = value

        inc = observe = lambda self, value=1, tags=None: self.set(value, tags)

    async def go():
        s = SchedulerService({"cpu0": FakeDevice(), "cpu1": FakeDevice()},
                             RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))   # never the shared log
        s.metrics = m = SchedulerMetrics(period_s=0)
        for name in ("dispatches", "swaps", "running", "loaded", "held"):
            setattr(m, name, Recorder())
        await s.submit(spec("n", "nataraj", model="a"))
        await s.submit(spec("g", "gana", model="b"))
        await lease_of(s, "n"), await lease_of(s, "g")
        m.refresh(s.policy.snapshot)
        return m
    m = asyncio.run(asyncio.wait_for(go(), 10))
    assert (("device", "cpu1"), ("kind", "gana"), ("model", "b"), ("tier", "T4")) in m.dispatches.seen
    assert set(m.swaps.seen) == {(("device", "cpu0"), ("model", "a"), ("swap_kind", "cold")),
                                 (("device", "cpu1"), ("model", "b"), ("swap_kind", "cold"))}
    assert m.running.seen[(("device", "cpu0"), ("kind", "nataraj"))] == 1
    assert m.running.seen[(("device", "cpu1"), ("kind", "nataraj"))] == 0
    assert m.loaded.seen == {(("device", "cpu0"), ("model", "a")): 1, (("device", "cpu1"), ("model", "b")): 1}


def test_status_view_warns_of_model_actors_below_the_hosts_programs():
    snap = {"now": 10.0, "loaded_model": "m", "foreground": {"kind": None, "subject": None}, "running": None,
            "queued": 0, "vruntime": {"kinds": {}, "producers": {}}, "next_wakeup": None,
            "t2": {"share": 0.0, "limit": 0.6, "over_budget": False}, "tiers": {"T0": [], "T1": [], "T2": [], "T3": [], "T4": []},
            "devices": [{"device": "cpu0", "loaded_model": "m", "running": None, "engine": {"niceness": 0}}]}
    for niceness, warned in ((0, False), (15, True)):
        snap["devices"][0]["engine"]["niceness"] = niceness
        console = Console(record=True, width=200)
        console.print(render(snap))
        text = console.export_text()
        assert ("model actors at niceness 15" in text and "RAY_worker_niceness=0" in text) is warned, text


def test_status_and_explain_name_the_devices_of_a_pool(tmp_path):
    async def go():
        s = SchedulerService({"cpu0": FakeDevice(), "cpu1": FakeDevice()},
                             RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        await s.submit(spec("n", "nataraj", model="a"))
        await s.submit(spec("g", "gana", model="b"))
        await lease_of(s, "n")
        g = await lease_of(s, "g")
        await s.submit(spec("c", "chat", model="b"))
        await asyncio.sleep(0.05)                       # g stops at its next token
        await s.release("g", g.epoch, "revoked")
        await lease_of(s, "c")
        return await s.status()
    snap = asyncio.run(asyncio.wait_for(go(), 10))
    console = Console(record=True, width=200)
    console.print(render(snap, read(tmp_path / "ev.jsonl")))
    text = console.export_text()
    assert "loaded models  cpu0 a, cpu1 b" in text
    assert re.search(r"▶ cpu0 \[a\] T4 nataraj .* job n", text) and re.search(r"▶ cpu1 \[b\] T0 chat .* job c", text)
    assert "g (gana): arrival of chat job c [cpu1]" in text
    told = "\n".join(explain(read(tmp_path / "ev.jsonl"), "c"))
    assert "dispatched at T0 on b, device cpu1" in told
    assert "behind g (gana from gana, T4, model b, device cpu1)" in told


def test_status_shows_each_device_on_its_node_and_the_pool_changes_of_a_cluster():
    """Several nodes (issue 29): the summary lists them with their devices, each device says
    on which it runs, and a node that died and the devices it took are in the recent list."""
    snap = {"now": 100.0, "loaded_model": "m", "foreground": {"kind": None, "subject": None}, "running": None,
            "queued": 0, "vruntime": {"kinds": {}, "producers": {}}, "next_wakeup": None,
            "t2": {"share": 0.0, "limit": 0.6, "over_budget": False}, "tiers": {t: [] for t in ("T0", "T1", "T2", "T3", "T4")},
            "devices": [{"device": "cpu0", "loaded_model": "m", "running": None, "node": "aa" * 28},
                        {"device": "cpu3", "loaded_model": None, "running": None, "node": "cc" * 28}],
            "nodes": [{"node": "aa" * 28, "address": "10.0.0.1", "head": True, "devices": ["cpu0"]},
                      {"node": "cc" * 28, "address": "10.0.0.3", "head": False, "devices": ["cpu3"]}]}
    events = [{"t": 95.0, "ev": "node", "node": "bb" * 28, "address": "10.0.0.2", "change": "left",
               "reason": "died unexpectedly"},
              {"t": 95.0, "ev": "device", "device": "cpu1", "change": "removed",
               "reason": "its node 10.0.0.2 (bbbbbbbb) died unexpectedly"}]
    console = Console(record=True, width=200)
    console.print(render(snap, events))
    text = console.export_text()
    assert "nodes          10.0.0.1 (head): cpu0; 10.0.0.3: cpu3" in text
    assert "▶ cpu0 [m] on 10.0.0.1" in text and "▶ cpu3 [empty] on 10.0.0.3" in text
    assert "node 10.0.0.2 (bbbbbbbb) left: died unexpectedly" in text
    assert "cpu1 removed: its node 10.0.0.2 (bbbbbbbb) died unexpectedly" in text
    del snap["nodes"][1:]                               # one node: nothing to tell apart
    console = Console(record=True, width=200)
    console.print(render(snap))
    assert " on 10.0.0" not in console.export_text() and "nodes " not in console.export_text()


def test_a_background_job_its_caller_withdrew_while_running_is_told_as_withdrawn_not_requeued():
    """Issue 27: a client that went away revokes its running nataraj; the log says `requeued`
    false, so the job is over there, not "still queued" until the log ends."""
    from uniun_ray.events.trace import Trace

    events = [submit(100.0, "n1", "nataraj", "nataraj:http"),
              job(100.0, "dispatch", "n1", "nataraj", "nataraj:http", swap=False, tier=4),
              job(101.0, "revoke", "n1", "nataraj", "nataraj:http", cause="cancel", reason="cancelled by its caller"),
              job(101.1, "finish", "n1", "nataraj", "nataraj:http", outcome="revoked", requeued=False),
              submit(119.6, "c1", "chat"), job(119.6, "dispatch", "c1", "chat", swap=False, tier=0),
              job(120.0, "finish", "c1", "chat", outcome="done")]
    rec = Trace(events).jobs["n1"]
    assert (rec.end, rec.outcome) == (101.1, "revoked") and list(Trace(events).waits(rec)) == []
    text = story(events, "n1")
    assert "revoked: cancelled by its caller" in text and "withdrawn by its caller, not re-queued" in text
    assert "re-queued" not in text.replace("not re-queued", "") and "still queued" not in text
    assert "in all: 1.100s from submit, 0.000s waiting" in text
    lost = events[:3] + [job(101.1, "finish", "n1", "nataraj", "nataraj:http", outcome="failed", requeued=True)]
    assert Trace(lost).jobs["n1"].end is None   # a job whose device was lost runs again elsewhere
