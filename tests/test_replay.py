"""The real-vs-simulated runner (issue 4, part 6) on real Ray with the `tiny` model: a
workload is played with the simulator's job ids, the scheduler's log comes back in the
simulator's schema, and the realized workload is what ran."""
from __future__ import annotations

import asyncio

import pytest

from uniun_ray import replay
from uniun_ray.sim.device import PROFILES, TINY
from uniun_ray.policy import Job
from uniun_ray.settings import SETTING
from uniun_ray.sim.workload import Arrival, Flow, FlowStep, ForegroundChange, SimJob, Workload

WORKLOAD = Workload(
    "replay-test", 0, "a Nataraj flow of two steps and one chat, on tiny",
    arrivals=(Arrival(1.0, SimJob(Job("chat:0#0", "chat", TINY, "chat:0"), 40, 8)),),
    flows=(Flow("nataraj", "nataraj", TINY, 0.0, (FlowStep(60, 30), FlowStep(70, 20, think_s=0.2))),),
    foreground=(ForegroundChange(0.5, "nataraj"),),
)


def test_prompt_for_hits_the_context_length_it_is_asked_for():
    text, tokens = replay.prompt_for(TINY, 120, 16)
    assert 110 <= tokens <= 120 and text.startswith("Tell the rest")


@pytest.fixture
def benchmark_runtime(ray_cluster, tmp_path, monkeypatch):
    """The runtime `play` gets from the benchmark (`replay.start_fresh`), where the warm start
    is on, as it is by default outside the tests: the play's precondition met as there."""
    from conftest import reset_uniun_actors

    monkeypatch.setenv(SETTING["warm_start"].env, "1")
    reset_uniun_actors(ray_cluster)
    replay.start_fresh(tmp_path / "events.jsonl")
    yield
    reset_uniun_actors(ray_cluster)


def test_a_played_workload_is_logged_scored_and_simulated_at_its_real_sizes(benchmark_runtime):
    played = asyncio.run(replay.play(WORKLOAD, timeout_s=120))
    assert played.errors == []
    submitted = [e["job"] for e in played.events if e["ev"] == "submit"]
    assert sorted(submitted) == ["chat:0#0", "nataraj#0", "nataraj#1"]  # the simulator's ids
    assert [e["kind"] for e in played.events if e["ev"] == "foreground"] == ["nataraj"]
    assert all(e["t"] >= 0 for e in played.events)  # from the start of the play
    flow = played.realized.flows[0]
    assert not flow.cycle and len(flow.steps) == 2 and flow.steps[1].think_s == 0.2
    assert flow.steps[0].prompt_tokens == replay.prompt_for(TINY, 60, 30)[1]
    assert all(1 <= s.output_tokens <= planned.output_tokens for s, planned in zip(flow.steps, WORKLOAD.flows[0].steps))

    text, predicted = replay.compare(played, PROFILES["cpu"])
    assert "| chat TTFT p50 s |" in text and "| swaps | 1 | 1 |" in text
    assert sorted(e["job"] for e in predicted if e["ev"] == "submit") == sorted(submitted)
