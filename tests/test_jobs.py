"""The user's flow end to end (issue 13): a plain `ray start --head` on private ports, then every
script in `jobs/` submitted with the working dir `.` (one through `ray job submit`, the others
through Ray's job SDK), each to succeed with its output checked, and where the actors went on
that plain head (tests/placement_scenario.py). The head runs with `--block` in its own process
group; the test ends that group (never `ray stop`, which would stop every Ray of this user)."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent   # the venv's: `ray`, and the `python` a job's entrypoint runs
STOP_GRACE_S = 3

#: script, arguments (the fast `tiny` model), what its output must show
JOBS = [
    ("chat.py", ["--turns", "2", "--max-new-tokens", "8"], r"chat: 2 turns, TTFT"),
    ("nataraj_fill.py", ["--deck", "2", "--take", "1", "--max-new-tokens", "16", "--timeout", "300"],
     r"refilled to 2/2"),
    ("extract_backfill.py", ["--notes", "4", "--rate", "8", "--open-after", "0.3", "--max-new-tokens", "8"],
     r"opened a note with \d+ jobs queued: its extraction \(T1\)"),
    ("gana_cron.py", ["--runs", "2", "--every", "1", "--model", "tiny", "--max-new-tokens", "8"],
     r"cron run due at \+[\d.]+s on tiny"),
    ("gana_agent.py", ["--model", "tiny-hermes", "--force-first", "--tasks", "1", "--chats", "1",
                       "--max-tokens", "48"],
     r"gana agent: 1 tasks, [1-9]\d* tool calls on tiny-hermes; chat TTFT beside it: [\d.]+s"),
    ("embed_flood.py", ["--texts", "32", "--batch", "8", "--concurrency", "4"], r"embedded 32 texts in 4 calls"),
    ("issue_118.py", ["--turns", "2", "--deck", "2", "--card-tokens", "400", "--chat-tokens", "4"],
     r"chat TTFT, while Nataraj fills: median [\d.]+s"),
]


#: Placement on a plain head (tests/placement_scenario.py joins the cluster it is submitted to),
#: with the embedder's concurrency set through the jobs' environment.
PLACEMENT = ("tests/placement_scenario.py", ['{"join": true}'])
EMBED_CONCURRENCY = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """`ray start --head --block` as a user would type it, on free ports, no custom resources."""
    port, dashboard = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{env['PATH']}"}
    temp_dir = tempfile.mkdtemp(prefix="uniun-jobs-", dir="/tmp")   # short: Ray's socket paths
    log = open(tmp_path_factory.mktemp("head") / "ray-start.log", "w")
    process = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--temp-dir={temp_dir}", f"--ray-client-server-port={free_port()}",
         f"--dashboard-agent-listen-port={free_port()}", "--object-store-memory=100000000"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"ray start exited: {Path(log.name).read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the head's dashboard never answered"
                time.sleep(0.5)
        yield url, env
    finally:
        # SIGTERM, then SIGKILL what is left: a blocking head takes ~30 s to stop gracefully;
        # its workers (the detached actors) exit on their own once their raylet is gone
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(60)
        log.close()


def tool_model(tmp_path_factory) -> Path:
    """`tiny` with a hermes tools template: the fast model gana_agent.py runs on here (its default
    is SmolLM2's weights under the same template)."""
    from uniun_ray.models import materialize, resolve
    from uniun_ray.models.requests.tool_templates import with_tools
    return with_tools(materialize(resolve("tiny")), tmp_path_factory.mktemp("tools") / "tiny-hermes")


@pytest.fixture(scope="module")
def submitted(head, tmp_path_factory):
    """Every script submitted at once, as several users' scripts share one head: one scheduler
    serves them all (and the module takes the longest job's time, not the sum). The first
    through `ray job submit` as a user types it; the others through Ray's job SDK, the same
    REST call without a CLI process of its own per job (each costs ~2 s of CPU to start)."""
    from ray.job_submission import JobSubmissionClient

    url, env = head
    runtime_env = {"working_dir": str(ROOT), "env_vars": {
        "UNIUN_CHAT_MODEL": "tiny", "UNIUN_STATE_DIR": os.environ["UNIUN_STATE_DIR"],
        "UNIUN_MODELS": f"tiny-hermes={tool_model(tmp_path_factory)}",   # gana_agent's model, whoever starts the runtime
        "UNIUN_EMBED_CONCURRENCY": str(EMBED_CONCURRENCY)}}
    (first, first_arguments), *others = \
        [(f"jobs/{script}", arguments) for script, arguments, _ in JOBS] + [PLACEMENT]
    client = JobSubmissionClient(url)   # first: its submissions wait for the head's job agent
    jobs = {path: Job(client, _submit(client, shlex.join(["python", path, *arguments]), runtime_env))
            for path, arguments in others}
    cli = subprocess.Popen(
        [str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", str(ROOT),
         "--runtime-env-json", json.dumps({"env_vars": runtime_env["env_vars"]}), "--",
         "python", first, *first_arguments],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    yield {first: cli} | jobs
    if cli.poll() is None:
        cli.kill()
    for job in jobs.values():
        job.stop()


def _submit(client, entrypoint: str, runtime_env: dict, patience_s: float = 120.0) -> str:
    """Submit as a user whose head is still starting would: the dashboard refuses a job until
    its job agent has registered ("No available agent to submit job, please try again later"),
    which on a busy 2-core host comes after the dashboard answers."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except RuntimeError as error:
            if "No available agent" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


@dataclass
class Job:
    """A job submitted through the SDK: waited for as `ray job submit` waits for it."""

    client: object
    job_id: str

    def output(self, timeout_s: float = 600) -> str:
        """Its logs once it succeeded (the test fails with them if it did not)."""
        from ray.job_submission import JobStatus

        deadline = time.monotonic() + timeout_s
        while (status := self.client.get_job_status(self.job_id)) not in \
                (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            assert time.monotonic() < deadline, f"{self.job_id} still {status} after {timeout_s} s"
            time.sleep(0.5)
        logs = self.client.get_job_logs(self.job_id)
        assert status == JobStatus.SUCCEEDED, f"{self.job_id}: {status}\n{logs[-4000:]}"
        return logs

    def stop(self) -> None:
        self.client.stop_job(self.job_id)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("script, arguments, expected", JOBS, ids=[job[0] for job in JOBS])
def test_each_job_script_succeeds_under_ray_job_submit(submitted, script, arguments, expected):
    output = succeeded(submitted[f"jobs/{script}"])
    assert re.search(expected, output), output[-4000:]


@pytest.mark.ray
@pytest.mark.slow
def test_a_plain_ray_start_places_everything_on_the_cpu_and_the_embedder_concurrency_is_a_setting(submitted):
    output = succeeded(submitted[PLACEMENT[0]])
    placed = json.loads(re.findall(r"^\{.*\}$", output, re.M)[-1])
    assert placed["model"] == {"device": "cpu", "resources": {}}
    assert placed["embedder"]["device"] == "cpu" and placed["embedder"]["resources"] == {}
    assert placed["embedder"]["peak_in_flight"] == EMBED_CONCURRENCY   # 12 callers, at most 3 at once


def succeeded(submission: subprocess.Popen | Job) -> str:
    """The output of a job that succeeded: a `ray job submit` that exited 0 and says so, or a
    job of the SDK whose status is SUCCEEDED."""
    if isinstance(submission, Job):
        return submission.output()
    output, _ = submission.communicate(timeout=600)
    assert submission.returncode == 0, output[-4000:]
    assert re.search(r"Job '\S+' succeeded", output), output[-4000:]
    return output
