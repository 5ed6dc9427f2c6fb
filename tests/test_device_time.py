"""Where a device's time went (benchmarks/device_time.py, the peers benchmark's accounting), on a
synthetic event log and two engine counters: every second of the window in one state, the
revokes with what they cost, the decode loop's steps and its idle while jobs held the device."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import device_time  # noqa: E402 (benchmarks/ is not a package)


def ev(t: float, name: str, job: str | None = None, kind: str = "nataraj", **fields) -> dict:
    return {"t": t, "ev": name} | ({"job": job, "kind": kind, "producer": kind, "model": "m"} if job else {}) | fields


#: Two background jobs from before the window; a chat at 104 revokes one (R23), which re-joins
#: when the chat ends; both end at 110; a job queued at 111 is dispatched at 113 with a swap.
LOG = [ev(95, "submit", "n1"), ev(95, "submit", "n2"), ev(96, "dispatch", "n1", swap=True),
       ev(96, "swap_start", "n1"), ev(98, "swap_end", "n1"), ev(98, "dispatch", "n2"),
       ev(104, "submit", "c", "chat"), ev(104, "dispatch", "c", "chat"),
       ev(104, "revoke", "n2", cause="step", chats=1, bound_s=0.096, step_profile={"1": 0.077, "2": 0.1}),
       ev(104.2, "finish", "n2", outcome="revoked", requeued=True), ev(106, "finish", "c", "chat", outcome="done"),
       ev(106, "dispatch", "n2"), ev(110, "finish", "n1", outcome="done"), ev(110, "finish", "n2", outcome="done"),
       ev(111, "submit", "n3"), ev(113, "dispatch", "n3", swap=True), ev(113, "swap_start", "n3"),
       ev(114, "swap_end", "n3")]
BEFORE = {"steps_by_batch": {"2": 10}, "step_s_by_batch": {"2": 1.0}, "process_cpu_s": 100.0, "threads": 2}
AFTER = {"steps_by_batch": {"1": 50, "2": 110}, "step_s_by_batch": {"0": 0.5, "1": 3.0, "2": 9.0},
         "process_cpu_s": 120.0, "threads": 2}
#: The same, from an engine that counts its stepping thread's CPU time in the steps.
BEFORE_CPU = BEFORE | {"step_cpu_s_by_batch": {"2": 0.9}}
AFTER_CPU = AFTER | {"step_cpu_s_by_batch": {"0": 0.5, "1": 2.5, "2": 8.8}}


def test_every_second_of_the_window_is_in_one_state_replayed_from_before_it():
    states = device_time.account(LOG, 100.0, 120.0)["states"]
    assert states == {"dev0": {"background at 2": 8.0, "chat beside 1": 2.0, "idle": 1.0,
                               "idle, a job queued": 2.0, "swap": 1.0, "background at 1": 6.0}}


def test_revokes_are_counted_by_cause_with_their_rejoins_and_costs():
    assert device_time.account(LOG, 100.0, 120.0)["revokes"] == {
        "by_cause": {"step": 1}, "rejoined": 1, "background_out_s": 2.0, "stop_s_mean": pytest.approx(0.2),
        "step_bound": {"least_s": 0.096, "most_s": 0.096, "step_profile": {"1": 0.077, "2": 0.1}}}
    rows = dict(device_time.rows(device_time.account(LOG, 100.0, 120.0)))
    assert rows["R23 at the revokes it caused: a chat's step bound, least / most; the step profile read at the "
                "last (rows: ms)"] == "96 / 96 ms; 1: 77, 2: 100"


def test_the_engines_counters_give_its_steps_and_its_idle_while_jobs_held_the_device():
    accounted = device_time.account(LOG, 100.0, 120.0, BEFORE, AFTER)
    assert accounted["steps"] == {0: (0, 0.5, None), 1: (50, 3.0, None), 2: (100, 8.0, None)}
    assert (accounted["held_s"], accounted["stepping_s"], accounted["loop_idle_while_held_s"]) == (16.0, 11.5, 4.5)
    rows = dict(device_time.rows(accounted))
    assert rows["dev0: time by state"].startswith("background at 2 8.0 s (40%); background at 1 6.0 s (30%)")
    steps = ("decode loop: steps by batch size (0: prompt only): seconds, steps, ms a step"
             " (of which off a core: the stepping thread waiting for the GIL or a core)")
    assert rows[steps] == "0: 0.5 s (2%); 1: 3.0 s (15%), 50, 60; 2: 8.0 s (40%), 100, 80"
    assert rows["decode loop: held by jobs / stepping / idle while held"] == "16.0 s (80%) / 11.5 s (57%) / 4.5 s (22%)"
    assert rows["model actor: CPU seconds; cores used on average; threads given"] == "20.0 s; 1.00; 2"
    assert device_time.account(LOG, 100.0, 120.0)["loop_idle_while_held_s"] is None   # no counters: not guessed
    counted = dict(device_time.rows(device_time.account(LOG, 100.0, 120.0, BEFORE_CPU, AFTER_CPU)))
    assert counted[steps] == "0: 0.5 s (2%); 1: 3.0 s (15%), 50, 60 (10 off a core); 2: 8.0 s (40%), 100, 80 (1 off a core)"


def test_the_peers_record_carries_uniun_rays_account_under_its_engine():
    from argparse import Namespace

    import peers

    ours = {"engine": peers.PEERS["uniun"].name, "settings": "s", "chat_ttft_p50_s": 0.1, "chat_ttft_p99_s": 0.2,
            "chats": 15, "background_tok_s": 30.0, "account": device_time.account(LOG, 100.0, 120.0, BEFORE, AFTER)}
    args = Namespace(record="peers", streams=4, background_tokens=200, chat_tokens=32, chat_every=8.0, duration=120.0)
    figures = {row.figure: row.measured for row in peers.record_rows([ours], args).rows}
    assert figures[f"{ours['engine']}: decode loop: held by jobs / stepping / idle while held"].startswith("16.0 s")
    assert figures[f"{ours['engine']}: revokes by cause; re-joins; background seconds out of a slot; mean stop"] == \
        "{'step': 1}; 1; 2.0 s; 200 ms"
