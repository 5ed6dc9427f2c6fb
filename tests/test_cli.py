"""`uniun-ray`: argument errors (no Ray), the client commands against the session's local
Ray (the `runtime` fixture), and `up`/`down` on a second head of their own (slow).

The up/down test starts a real head in a fresh temp dir, on free ports, with its own state
file, as a subprocess; `down` only signals the process group `up` recorded, so it cannot
touch the test session's cluster or anyone else's. Its `finally` stops the head whatever
happened."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

import uniun_ray
from uniun_ray import cli
from uniun_ray.runtime.head import HeadState, stop_head


@pytest.fixture
def state_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("UNIUN_STATE_DIR", str(tmp_path))
    return tmp_path / "up.json"


@pytest.fixture
def no_connection(monkeypatch):
    """As if this process were not connected to Ray (the session cluster may be up)."""
    import ray
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- usage errors: exit 2, one line, no Ray ------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    ([], "COMMAND"),
    (["launch"], "invalid choice: 'launch'"),
    (["foreground", "poem"], "'chat', 'nataraj', 'gana', 'extract', 'none'"),
    (["foreground", "none", "--subject", "note-1"], "--subject needs a kind"),
    (["chat"], "the following arguments are required: prompt"),
    (["up", "--auth", "open"], "invalid choice: 'open'"),
    (["up", "--devices", "0"], "'0' is not a device count"),
    (["embed"], "the following arguments are required: TEXT"),
])
def test_usage_errors_exit_2_with_a_message(argv, expected, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_up_devices_declares_that_many_stand_in_devices_on_a_cpu_machine(state_file, monkeypatch):
    from uniun_ray.runtime import head

    class Started(Exception):
        pass

    def ray_start(command, **kwargs):
        raise Started(command, kwargs["env"])

    import types
    monkeypatch.setattr(head, "subprocess", types.SimpleNamespace(Popen=ray_start, PIPE=-1, STDOUT=-2))
    monkeypatch.setattr(head, "_ray_executable", lambda: "ray")
    monkeypatch.setattr(head, "gpu_count", lambda: 0)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(Started) as started:
        cli.main(["up", "--devices", "3"])
    assert '--resources={"uniun_device": 3, "uniun_embedder": 1}' in started.value.args[0]
    monkeypatch.setattr(head, "gpu_count", lambda: 2)     # GPUs are the devices: no stand-ins
    with pytest.raises(Started) as started:
        cli.main(["up", "--devices", "3"])
    assert "--resources={}" in started.value.args[0]
    # the head's workers (every actor) at niceness 0, not Ray's 15; an explicit setting wins
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    with pytest.raises(Started) as started:
        cli.main(["up"])
    assert started.value.args[1]["RAY_worker_niceness"] == "0"
    monkeypatch.setenv("RAY_worker_niceness", "5")
    with pytest.raises(Started) as started:
        cli.main(["up"])
    assert started.value.args[1]["RAY_worker_niceness"] == "5"


def test_help_and_bench_help_exit_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "foreground" in capsys.readouterr().out
    assert cli.main(["bench", "--help"]) == 0
    assert "--workloads" in capsys.readouterr().out


# -- no cluster: exit 1, says to run `uniun-ray up` ----------------------------------------
def test_no_cluster_found_says_run_up(state_file, no_connection, monkeypatch, capsys):
    from uniun_ray.runtime import launch
    monkeypatch.setattr(launch, "_ray_start_address", lambda: None)
    assert cli.main(["status"]) == 1
    assert "no running Ray cluster found: start one with `uniun-ray up`" in capsys.readouterr().err


def test_unreachable_address_fails_fast(state_file, no_connection, capsys):
    port = free_port()  # nothing listens there
    assert cli.main(["embed", "hello", "--address", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in err and "uniun-ray up" in err


def test_down_without_up_is_a_no_op(state_file, capsys):
    assert cli.main(["down"]) == 0
    assert "nothing to stop" in capsys.readouterr().out


def test_down_forgets_a_stale_head_and_signals_nothing(state_file, capsys):
    # Our own pid with a wrong start time: a reused pid must never be signalled.
    HeadState(address="127.0.0.1:1", dashboard_url=None, auth_mode="disabled", pgid=os.getpgid(0),
              processes=[[os.getpid(), 1.0]], started_at=0.0).save()
    assert cli.main(["down"]) == 0
    assert "no longer running" in capsys.readouterr().out
    assert not state_file.exists()


def test_a_recorded_process_is_known_across_a_one_second_shift_of_the_boot_time():
    """psutil's start time on Linux moves with /proc/stat's btime (whole seconds, recomputed from
    the wall clock): the process that reads it later may see it a second off."""
    import psutil

    created = psutil.Process().create_time()
    shifted = HeadState(address="127.0.0.1:1", dashboard_url=None, auth_mode="disabled", pgid=os.getpgid(0),
                        processes=[[os.getpid(), created - 1.0]], started_at=0.0)
    assert [p.pid for p in shifted.alive()] == [os.getpid()]
    reused = HeadState(address="127.0.0.1:1", dashboard_url=None, auth_mode="disabled", pgid=os.getpgid(0),
                       processes=[[os.getpid(), created - 60.0]], started_at=0.0)
    assert reused.alive() == []


# -- the client commands against a real local Ray ------------------------------------------
@pytest.mark.ray
def test_status_foreground_and_embed(runtime, capsys):
    assert cli.main(["foreground", "extract", "--subject", "note-7"]) == 0
    assert "foreground: extract (subject note-7)" in capsys.readouterr().out
    assert uniun_ray.status()["foreground"] == {"kind": "extract", "subject": "note-7"}

    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "extract (note-7)" in out and "fair pool" in out
    assert cli.main(["status", "--json"]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    assert set(snapshot["tiers"]) == {"T0", "T1", "T2", "T3", "T4"} and snapshot["queued"] == 0
    assert snapshot["engine"]["niceness"] == 0    # a local cluster's workers run at 0, not Ray's 15

    assert cli.main(["foreground", "none"]) == 0
    assert capsys.readouterr().out == "foreground: none\n"
    assert uniun_ray.status()["foreground"] == {"kind": None, "subject": None}

    assert cli.main(["embed", "hello", "the river", "--values", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("384 dims [") for line in lines)


@pytest.mark.ray
@pytest.mark.slow
def test_chat_streams_and_prints_ttft_and_rejects_unknown_models(runtime, capsys):
    assert cli.main(["chat", "Once upon a time", "--model", "tiny", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "TTFT " in captured.err and "tiny" in captured.err
    assert cli.main(["chat", "hi", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "known ids: " in err and "Traceback" not in err


# -- up and down, on a head of their own ---------------------------------------------------
def run_cli(*argv: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "uniun_ray.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.slow
def test_up_then_down_stops_exactly_that_head(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="uniun-up-", dir="/tmp")  # short: Ray's socket paths
    state = tmp_path / "up.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["UNIUN_STATE_DIR"] = str(tmp_path)   # up.json and the event log
    env["UNIUN_EMBED_CONCURRENCY"] = "3"
    port, dashboard, http = free_port(), free_port(), free_port()
    try:
        up = run_cli("up", "--port", str(port), "--dashboard-port", str(dashboard), "--temp-dir", temp_dir,
                     "--http-port", str(http), "--slots", "1",
                     "--", f"--ray-client-server-port={free_port()}",
                     f"--dashboard-agent-listen-port={free_port()}", env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"dashboard: http://127.0.0.1:{dashboard}" in up.stdout
        assert re.search(r"actors: scheduler, model:(cpu|gpu)0, embedder", up.stdout), up.stdout  # any host
        assert f"event log: {tmp_path}/events.jsonl" in up.stdout  # the scheduler's own
        assert f"http: http://127.0.0.1:{http}/v1 (OpenAI-compatible; no API key)" in up.stdout
        assert f"live page: http://127.0.0.1:{http}/" in up.stdout
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=30).read())
        assert "tiny" in [m["id"] for m in models["data"]]   # SPEC §4 served by `up`
        head = HeadState.load(state)
        assert head.auth_mode == "disabled" and head.session_dir.startswith(temp_dir)
        assert head.alive() and head.address.endswith(f":{port}")

        again = run_cli("up", env=env)
        assert again.returncode == 0 and "already up" in again.stdout

        status = run_cli("status", "--json", env=env)  # finds the head through the state file
        assert status.returncode == 0, status.stderr
        snapshot = json.loads(status.stdout)
        assert snapshot["queued"] == 0 and snapshot["engine"]["niceness"] == 0   # not Ray's 15
        settings = {row["setting"]: (row["value"], row["source"]) for row in snapshot["settings"]}
        assert settings["UNIUN_SLOTS"] == ("1", "flag") and settings["UNIUN_EMBED_CONCURRENCY"] == ("3", "environment")
        assert snapshot["engine"]["memory"]["parts"]["prefix_cache"]["planned_mb"] > 0   # the device's plan

        down = run_cli("down", env=env)
        assert down.returncode == 0 and "stopped the Ray head" in down.stdout, down.stdout + down.stderr
        assert not head.alive() and not state.exists()
    finally:
        leftover = HeadState.load(state)
        if leftover is not None:
            stop_head(leftover)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_slots_setting_is_auto_or_a_count_and_a_bad_one_is_refused_before_anything_starts(monkeypatch):
    from uniun_ray.settings import Settings, parse_slots
    from uniun_ray.runtime.launch import config_from

    assert parse_slots("auto") is None and parse_slots("") is None and parse_slots(" 8 ") == 8
    for bad in ("0", "-1", "many", "257"):
        with pytest.raises(ValueError, match=f"UNIUN_SLOTS='{bad}' is not allowed: use 'auto' or a count from 1 to 256"):
            parse_slots(bad)
    monkeypatch.setenv("UNIUN_SLOTS", "4")
    assert config_from().slots == 4 and config_from(Settings.load(flags={"slots": "auto"})).slots is None
    assert config_from(Settings.load(flags={"slots": "2"})).slots == 2
