"""Fail fast, never a 500 (issue 35): an engine this host cannot run is refused at `uniun-ray
up` and at `start()`, before a head or an actor exists; a model a device cannot load fails its
job with ModelUnavailable, which HTTP answers 503 with the cause, never 500.

The vLLM environment is pointed at an empty folder (UNIUN_CACHE_DIR, no UNIUN_VLLM_PYTHON), so
these hold on a machine where `make install-vllm` has run too. No Ray here."""
from __future__ import annotations

import asyncio

import pytest

from conftest import FakeDevice, lease_of, spec


@pytest.fixture
def no_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIUN_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("UNIUN_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("UNIUN_ENGINE", "vllm")


def test_up_with_an_engine_this_host_cannot_run_is_refused_before_the_head_starts(no_vllm, monkeypatch, capsys):
    from uniun_ray import cli
    from uniun_ray.runtime import head

    def started(**kwargs):
        raise AssertionError("the head started")
    monkeypatch.setattr(head, "start_head", started)
    monkeypatch.setattr(head.HeadState, "load", classmethod(lambda cls, *a: None))
    monkeypatch.setattr(head.HeadState, "forget", classmethod(lambda cls, *a: None))
    assert cli.main(["up", "--engine", "vllm", "--no-http"]) == 1
    error = capsys.readouterr().err
    assert "no vLLM environment" in error and "make install-vllm" in error and "Traceback" not in error, error


def test_start_with_an_engine_this_host_cannot_run_is_refused_before_any_actor(no_vllm, monkeypatch):
    from uniun_ray import EngineUnavailable
    from uniun_ray.runtime import launch

    def connected():
        raise AssertionError("start() went on to Ray")
    monkeypatch.setattr(launch, "connect", connected)
    with pytest.raises(EngineUnavailable, match="make install-vllm"):
        launch.start()


def test_a_model_the_device_cannot_load_fails_its_job_with_the_cause_and_http_says_503():
    from uniun_ray.http.errors import from_client
    from uniun_ray.runtime.protocol import ModelUnavailable
    from uniun_ray.runtime.service import RuntimeConfig, SchedulerService

    class NoEngine(FakeDevice):
        async def load(self, model_id: str) -> float:
            raise RuntimeError("no vLLM environment at /x/bin/python: run `make install-vllm`\nTraceback ...")

    async def go():
        service = SchedulerService(NoEngine(), RuntimeConfig(reap_period_s=0.05))
        await service.submit(spec("a", "chat"))
        with pytest.raises(ModelUnavailable) as failed:
            await lease_of(service, "a")
        return failed.value
    error = asyncio.run(go())
    assert str(error) == "model 'm' cannot run on device dev0: no vLLM environment at /x/bin/python: run `make install-vllm`"
    answer = from_client(error)
    assert (answer.status, answer.code, answer.type) == (503, "model_unavailable", "service_unavailable")
    assert "make install-vllm" in answer.message


def test_a_local_ray_whose_node_registers_late_is_started_again_and_other_errors_are_not(monkeypatch):
    """Ray gives its raylet 30 s to register with the GCS, then raises a bare Exception: on a
    busy host a new Ray can take longer, and a second start usually succeeds. Any other error
    of `ray.init` is the caller's to see, at once."""
    from uniun_ray.runtime import launch

    calls, errors = [], [Exception("The current node timed out during startup. This could happen ...")]
    def init(**kwargs):
        calls.append(kwargs)
        if errors:
            raise errors.pop()
        return "context"
    monkeypatch.setattr(launch.ray, "init", init)
    monkeypatch.setattr(launch.ray, "shutdown", lambda: calls.append("shutdown"))
    assert launch.init_local() == "context"
    assert calls[1] == "shutdown" and len(calls) == 3
    errors[:] = [ValueError("auth mode")]
    with pytest.raises(ValueError, match="auth mode"):
        launch.init_local()
    errors[:] = [Exception("The current node timed out during startup.")] * launch.STARTS
    with pytest.raises(Exception, match="timed out during startup"):
        launch.init_local()
    assert not errors
