"""Shared fixtures and fakes. One local Ray cluster per test session (`local_cluster`: no
dashboard, a small object store, the stand-in device resources); tests that need it ask for
`runtime`, which gives them a fresh scheduler with short lease timeouts beside model actors
reset to a just-started device (`reset_uniun_actors`). The fakes of the Ray-free protocol tests
(`FakeDevice`, `spec`, `lease_of`) live here once; test modules import them (`from conftest
import ...`). The wait for a generating job (`started`) is in `waits`, which the subprocess
scenarios share."""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

import pytest

from uniun_ray.runtime.head import worker_niceness

os.environ["RAY_AUTH_MODE"] = "disabled"  # explicit, always (see README)
# every Ray a test starts, a plain `ray start` included, runs its workers at uniun-ray's
# niceness (0, as the README says to start Ray), whichever fixture starts one first
worker_niceness()
# the scheduler's event log and other state go to a scratch dir, never the user's
# (a fresh one per pytest process, even where the user has set UNIUN_STATE_DIR)
os.environ["UNIUN_STATE_DIR"] = tempfile.mkdtemp(prefix="uniun-test-state-")
#: One slot per device unless a test asks for more: the R1-R20 scenarios, the jobs and the CLI
#: are about one job at a time; the slot tests set their count (and "auto") themselves.
os.environ.setdefault("UNIUN_SLOTS", "1")
#: No warm start (issue 37): a test's runtime starts with its devices empty, as the tests of
#: swaps, loads and the event log expect; test_swaps_runtime tests the warm start itself.
os.environ.setdefault("UNIUN_WARM_START", "0")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from uniun_ray.runtime.launch import local_cluster

    # A test that made a ModelActor in-process (its Ray metrics) started a Ray of its own, never
    # shut down: where it ran first on a worker, every test of the session's cluster failed to set
    # up ("ray.init twice"; a shuffled order, seed 1000032926). That Ray is not the session's.
    if ray.is_initialized():
        ray.shutdown()
    # metrics exported every 2 s, not Ray's 10 s: a test that reads them waits less
    with local_cluster(object_store_memory=100 * 1024 * 1024,
                       _system_config={"metrics_report_interval_ms": 2000}):
        yield ray


# -- scenarios on private clusters ------------------------------------------------------------
def spawn_scenario(script: Path, *args: str, env: dict | None = None):
    """`python script args` with its own Ray (auth disabled, no RAY_ADDRESS to join) and this
    checkout's uniun_ray first on its path, stdout and stderr piped: a module's `launch`."""
    import subprocess

    root = Path(__file__).parent.parent
    environ = os.environ | {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])} | (env or {})
    environ.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environ, cwd=root)


@pytest.fixture(scope="module")
def scenario_result(request):
    """`scenario_result(name)`: the JSON object the scenario `name` printed last, once it
    exited 0. A scenario needs a private cluster with other resources than the session's, so
    it is a subprocess, started by its module's `launch(name)`. Every scenario the module's
    selected tests read (`@pytest.mark.scenario(name)`) starts at once: each is mostly waiting
    (a cluster starting, actors importing torch). Started with the session instead, beside the
    Ray-free tests, they made the suite slower on 2 cores, not faster."""
    import json
    import subprocess

    wanted = {mark.args[0] for item in request.session.items if item.module is request.module
              for mark in item.iter_markers("scenario")}
    running = {name: request.module.launch(name) for name in sorted(wanted)}
    results: dict[str, dict] = {}

    def result(name: str) -> dict:
        if name not in results:
            try:
                stdout, stderr = running[name].communicate(timeout=600)
            except subprocess.TimeoutExpired:
                running[name].kill()
                raise
            assert running[name].returncode == 0, stdout[-2000:] + stderr[-4000:]
            results[name] = json.loads(stdout.strip().splitlines()[-1])
        return results[name]
    yield result
    for process in running.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def _kill_and_wait(ray, name: str) -> None:
    """Kill the named actor for good and wait until its name is free again."""
    import time

    from uniun_ray.runtime.protocol import NAMESPACE

    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)


def _model_actor_names(ray) -> list[str]:
    from uniun_ray.runtime.protocol import NAMESPACE, model_actor_name

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(model_actor_name(""))]


#: A reset that takes longer than this means a wedged device: it is killed and made anew.
RESET_TIMEOUT_S = 30.0


def reset_uniun_actors(ray) -> None:
    """A fresh runtime for the next test, at the price of a new scheduler only: the scheduler
    (whose policy state is per test) is killed; every model actor is reset to a just-started
    device (no model, no cached KV, no stop history) and the embedder (stateless) kept. A new
    model actor costs ~8 s here (a process importing torch, then a model load); made anew for
    every test it was a third of the suite. One that does not reset in time, or is dead, is
    killed and made anew by `start`."""
    from uniun_ray.runtime.protocol import NAMESPACE, SCHEDULER_NAME

    _kill_and_wait(ray, SCHEDULER_NAME)
    for name in _model_actor_names(ray):
        try:
            ray.get(ray.get_actor(name, namespace=NAMESPACE).reset.remote(), timeout=RESET_TIMEOUT_S)
        except ValueError:
            continue  # gone meanwhile
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            _kill_and_wait(ray, name)


@pytest.fixture
def make_runtime(ray_cluster):
    """A fresh scheduler, with short lease timeouts and the policy configuration a test asks
    for, beside reset model actors and the kept embedder (`reset_uniun_actors`)."""
    from uniun_ray.policy import PolicyConfig
    from uniun_ray.runtime.launch import start
    from uniun_ray.runtime.service import RuntimeConfig

    def make(policy: PolicyConfig | None = None, **runtime):
        reset_uniun_actors(ray_cluster)
        # 5 s, as the subprocess scenarios have it: a caller's poll comes every third of it, and
        # at 3 s a busy 2-core host (two workers and a burner) once held one back past the timeout
        fields = dict(lease_timeout_s=5.0, waiter_timeout_s=5.0, reap_period_s=0.2, slots=1) | runtime
        return start(RuntimeConfig(policy or PolicyConfig(), **fields))

    yield make
    reset_uniun_actors(ray_cluster)


@pytest.fixture
def runtime(make_runtime):
    return make_runtime()


@pytest.fixture(scope="session")
def long_tokens(ray_cluster) -> int:
    """max_new_tokens of `tiny` that keep the device busy ~2 s (`long_run`), measured once per
    session through a fresh runtime."""
    from long_run import long_tokens_at, tiny_seconds_per_token

    from uniun_ray.policy import PolicyConfig
    from uniun_ray.runtime.launch import start
    from uniun_ray.runtime.service import RuntimeConfig

    reset_uniun_actors(ray_cluster)
    start(RuntimeConfig(PolicyConfig(), slots=1))
    try:
        seconds = asyncio.run(tiny_seconds_per_token())
    finally:
        reset_uniun_actors(ray_cluster)
    tokens = long_tokens_at(seconds)
    _MEASURED.append(f"tiny through the runtime: {seconds * 1e3:.2f} ms/token; a long run is {tokens} tokens")
    return tokens


_MEASURED: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    """What the session measured of this host, beside the results (a failure reads differently
    on a host where a long run was 400 tokens)."""
    for line in _MEASURED:
        terminalreporter.write_line(line)


def pytest_sessionfinish(session) -> None:
    """An xdist worker hands what it measured to the controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["measured"] = _MEASURED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controller's side of `pytest_sessionfinish`: each worker's lines, as it stops."""
    _MEASURED.extend(f"{line} ({node.gateway.id})" for line in getattr(node, "workeroutput", {}).get("measured", []))


# -- fakes for the Ray-free protocol tests (SchedulerService with a fake device) ---------------
async def settle(rounds: int = 50) -> None:
    """Let every task that can run do so (each round is one pass of the event loop)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class ManualClock:
    """The scheduler's clock (`runtime.clock.Clock`) moved by hand: time stands still until
    `advance`, which runs each timer that falls due meanwhile at its own time, then lets the
    loop settle. A test that drives a timeout, a deadline or the reaper with it waits for no
    real time and asserts on the exact one. It starts at the real epoch time, as deadlines are
    checked against time.time()."""

    def __init__(self) -> None:
        import time

        self.now = time.time()
        self._sleepers: list[tuple[float, asyncio.Future]] = []

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        woken = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + max(0.0, seconds), woken))
        await woken

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        sleeping, setting = asyncio.ensure_future(self.sleep(timeout_s)), asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({sleeping, setting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeping.cancel()
            setting.cancel()
        return event.is_set()

    async def advance(self, seconds: float = 0.0) -> None:
        target = self.now + seconds
        await settle()
        while True:
            self._sleepers = [(at, woken) for at, woken in self._sleepers if not woken.done()]
            due = min((at for at, _ in self._sleepers), default=None)
            if due is None or due > target:
                break
            self.now = max(self.now, due)
            for at, woken in self._sleepers:
                if at <= self.now:
                    woken.set_result(None)
            await settle()
        self.now = target
        await settle()


class FakeDevice:
    """The device as the scheduler sees it: loads (optionally slow, on `clock` where given, or
    failing for the models in `fail`; given up while in flight when asked to `abandon`), grants
    and revokes are recorded; `epoch` is what it was last granted. Set `gone` and every call raises DeviceGone, as a ModelActor killed for good
    does."""

    def __init__(self, load_s: float = 0.0, fail: set[str] = frozenset(), clock: ManualClock | None = None) -> None:
        self.load_s, self.fail, self.clock = load_s, fail, clock
        self.loads: list[str] = []
        self.abandoned: list[str] = []   # the loads given up (R13)
        self._loading: tuple[str, asyncio.Event] | None = None
        self.granted: list[int] = []
        self.revoked: list[int] = []
        self.epoch = 0
        self.live: tuple[int, ...] = ()   # the epochs the last grant kept live
        self.gone = False

    def _answer(self) -> None:
        from uniun_ray.runtime.protocol import DeviceGone

        if self.gone:
            raise DeviceGone("the fake device is gone")

    async def load(self, model_id: str):
        from uniun_ray.models.swap import COLD, Swap, SwapAbandoned
        from uniun_ray.runtime.clock import Clock

        self._loading = (model_id, asyncio.Event())
        try:
            abandoned = await (self.clock or Clock()).wait(self._loading[1], self.load_s)
        finally:
            self._loading = None
        if abandoned:
            self.abandoned.append(model_id)
            raise SwapAbandoned(f"the load of {model_id} was abandoned")
        self._answer()
        if model_id in self.fail:
            raise RuntimeError(f"cannot load {model_id}")
        self.loads.append(model_id)
        return Swap(model_id, COLD, self.load_s)

    async def abandon(self, model_id: str) -> None:
        if self._loading is not None and self._loading[0] == model_id:
            self._loading[1].set()

    async def grant(self, epoch: int, live: tuple[int, ...] = (), model: str | None = None) -> None:
        self._answer()
        assert epoch > self.epoch, "epochs only grow"
        assert epoch in live, "a grant names its own epoch among the live ones"
        self.epoch, self.live = epoch, live
        self.granted.append(epoch)

    async def revoke(self, epoch: int) -> None:
        self._answer()
        self.revoked.append(epoch)

    async def current_epoch(self) -> int:
        self._answer()
        return self.epoch

    async def alive(self) -> bool:
        return not self.gone


def spec(job_id: str, kind: str, model: str = "m", **fields):
    """A job as the client submits it (the policy's `Job`, validated as the client does)."""
    from uniun_ray.runtime.protocol import new_job

    return new_job(kind, model, job_id=job_id, **fields)


async def lease_of(service, job_id: str, wait_s: float = 0.05):
    """Poll like a client does until the job's lease comes."""
    while (lease := await service.grant(job_id, wait_s=wait_s)) is None:
        pass
    return lease
