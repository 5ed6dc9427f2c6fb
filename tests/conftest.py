"""Shared fixtures. One local Ray cluster per test session (address="local", no dashboard,
a small object store, the stand-in device resources); tests that need it ask for `runtime`,
which gives them freshly created actors with short lease timeouts."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"  # explicit, always (see README)
# the scheduler's event log and other state go to a scratch dir, never the user's
os.environ.setdefault("UNIUN_STATE_DIR", tempfile.mkdtemp(prefix="uniun-test-state-"))
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from uniun_ray.runtime.launch import LOCAL_RESOURCES
    from uniun_ray.runtime.protocol import NAMESPACE

    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 * 1024, resources=LOCAL_RESOURCES)
    yield ray
    ray.shutdown()


def kill_uniun_actors(ray) -> None:
    """Kill the named actors and wait until their names are free again."""
    import time

    from uniun_ray.runtime.launch import device_name
    from uniun_ray.runtime.protocol import EMBEDDER_NAME, NAMESPACE, SCHEDULER_NAME, model_actor_name

    for name in (SCHEDULER_NAME, model_actor_name(device_name()), EMBEDDER_NAME):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            continue
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.05)


@pytest.fixture
def make_runtime(ray_cluster):
    """Fresh scheduler, model actor and embedder, with short lease timeouts and the policy
    configuration a test asks for."""
    from uniun_ray.policy import PolicyConfig
    from uniun_ray.runtime.launch import start
    from uniun_ray.runtime.service import RuntimeConfig

    def make(policy: PolicyConfig | None = None, **runtime):
        kill_uniun_actors(ray_cluster)
        fields = dict(lease_timeout_s=3.0, waiter_timeout_s=3.0, reap_period_s=0.2) | runtime
        return start(RuntimeConfig(policy or PolicyConfig(), **fields))

    yield make
    kill_uniun_actors(ray_cluster)


@pytest.fixture
def runtime(make_runtime):
    return make_runtime()
