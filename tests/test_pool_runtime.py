"""The pool of devices (SPEC §5, issue 16) on a real local Ray with two stand-in devices and
real models: two jobs on two models at once, one revoke when a chat finds both devices busy,
and a ModelActor killed for good whose job completes on the other device. One private
cluster in a subprocess (`pool_scenario.py`), shared by the tests of this module: the
session's cluster declares one device and stays so."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from conftest import spawn_scenario

pytestmark = [pytest.mark.ray, pytest.mark.scenario("pool")]

SCENARIO = Path(__file__).parent / "pool_scenario.py"


def launch(name: str):
    """Start the pool scenario (conftest's `scenario_result`); its state (the event log) goes
    to a scratch dir of its own."""
    return spawn_scenario(SCENARIO, env={"UNIUN_STATE_DIR": tempfile.mkdtemp(prefix="uniun-pool-state-")})


@pytest.fixture(scope="module")
def pool_run(scenario_result) -> dict:
    out = scenario_result("pool")
    print(f"pool scenario: actors up in {out['start_s']:.1f}s, a long run is {out['long']} tokens, "
          f"then {out['phases_s']}")
    return out


def runs(events: list[dict], job: str) -> list[tuple[float, float, str]]:
    """(dispatch, finish, device) of each run of `job`."""
    out, start = [], None
    for e in events:
        if e.get("job") != job:
            continue
        if e["ev"] == "dispatch":
            start = e
        elif e["ev"] == "finish" and start is not None:
            out.append((start["t"], e["t"], e["device"]))
            start = None
    return out


def job_of(events: list[dict], kind: str) -> str:
    """The one job of `kind` (the scenario's Natarajs are named by its completions: the long
    run's measurement submits Natarajs too)."""
    jobs = [e["job"] for e in events if e["ev"] == "submit" and e["kind"] == kind]
    assert len(jobs) == 1, jobs
    return jobs[0]


def test_two_jobs_on_two_models_run_at_the_same_time_on_two_devices(pool_run):
    busy = pool_run["both_busy"]["devices"]
    assert sorted((d["running"]["kind"], d["loaded_model"]) for d in busy) == \
        [("gana", "smollm2-135m-instruct"), ("nataraj", "tiny")]
    assert all(d["engine"].get("model") == d["loaded_model"] for d in busy)   # each device's own engine
    cores = len(os.sched_getaffinity(0))                  # two stand-ins of one node share its cores
    share = max(1, cores // 2)                            # at most; the probe may keep fewer
    assert all(d["engine"]["threads_setting"] == f"auto, up to {share}" and d["engine"]["threads"] <= share
               for d in busy), [d["engine"] for d in busy]
    events = pool_run["events"]
    (g_start, g_end, g_device), = runs(events, job_of(events, "gana"))
    n_start, n_end, n_device = runs(events, pool_run["card"]["job"])[0]
    assert g_device != n_device and n_start < g_end and g_start < n_end     # the log shows the overlap
    assert pool_run["gana_device"] == g_device
    assert pool_run["model_actors"] == ["model:cpu0", "model:cpu1"]


def test_a_chat_on_a_busy_pool_revokes_exactly_one_job(pool_run):
    events = pool_run["events"]
    chat = job_of(events, "chat")
    asked = next(e["t"] for e in events if e["ev"] == "submit" and e["job"] == chat)
    answered = next(e["t"] for e in events if e["ev"] == "finish" and e["job"] == chat)
    revokes = [e for e in events if e["ev"] == "revoke" and asked <= e["t"] <= answered]
    card = pool_run["card"]["job"]
    assert [(e["job"], e["cause"]) for e in revokes] == [(card, "arrival")]  # the one holding tiny (R18)
    (chat_start, _, chat_device), = runs(events, chat)
    assert chat_device == revokes[0]["device"]
    assert pool_run["chat"]["revokes"] == 0 and pool_run["chat"]["tokens"] == 16
    assert pool_run["card"]["revokes"] == 1 and pool_run["card"]["tokens"] == pool_run["long"]  # resumed, completed


def test_a_model_actor_killed_for_good_requeues_its_job_which_completes_on_the_other_device(pool_run):
    events, killed = pool_run["events"], pool_run["killed"]
    second = pool_run["second"]["job"]
    *_, (_, _, last_device) = runs(events, second)
    assert runs(events, second)[0][2] == killed and last_device != killed
    removed = [e for e in events if e["ev"] == "device" and e["change"] == "removed"]
    assert [e["device"] for e in removed] == [killed]
    lost = [e for e in events if e["ev"] == "finish" and e["job"] == second and e.get("requeued")]
    assert lost and lost[0]["device"] == killed
    assert pool_run["second"]["tokens"] == pool_run["long"] and pool_run["second"]["text"]
    # the seat it freed is still declared: the scheduler made a new ModelActor there
    assert [e["device"] for e in events if e["ev"] == "device" and e["change"] == "added"] == [killed]
    assert sorted(d["device"] for d in pool_run["healed"]["devices"]) == ["cpu0", "cpu1"]
