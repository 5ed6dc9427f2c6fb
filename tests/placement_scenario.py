"""One placement scenario on a private local Ray (run by tests/test_placement.py in a
subprocess: each scenario needs a cluster with other resources than the session's), or on the
cluster it runs in (`"join": true`: tests/test_jobs.py submits it to its plain `ray start` head).

    python tests/placement_scenario.py '{"num_gpus": 1, "resources": {}, "then_hold_gpus": 1}'
    ray job submit ... -- python tests/placement_scenario.py '{"join": true}'

Prints one JSON line: where the actors went; with `then_hold_gpus`, the actors are then killed,
another job takes that many GPUs, and the line also holds the error `start()` raised and how
long it took.
"""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from uniun_ray.runtime.launch import forget_handles, start
from uniun_ray.runtime.protocol import EMBEDDER_NAME, NAMESPACE, SCHEDULER_NAME, model_actor_name


@ray.remote(num_cpus=0)
class Squatter:
    """Holds GPUs, as another user's job would."""

    def ping(self) -> str:
        return "ok"


def refused_start(h, gpus: int) -> dict:
    """Kill the actors, let another job take `gpus` GPUs, and start again: the refusal."""
    for actor in (h.scheduler, h.model, h.embedder):   # the scheduler first: it re-creates model actors
        ray.kill(actor, no_restart=True)
    forget_handles()
    while any(_exists(name) for name in (model_actor_name("gpu0"), EMBEDDER_NAME, SCHEDULER_NAME)):
        time.sleep(0.05)
    squatter = Squatter.options(num_gpus=gpus).remote()
    ray.get(squatter.ping.remote())
    began = time.monotonic()
    try:
        start()
    except Exception as error:  # noqa: BLE001 - the error is what this scenario reports
        return {"error": f"{type(error).__name__}: {error}", "after_s": time.monotonic() - began}
    return {"error": None}


def _exists(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def main() -> None:
    scenario = json.loads(sys.argv[1])
    if scenario.get("join"):
        ray.init(namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
                 object_store_memory=80 * 1024 * 1024, num_gpus=scenario["num_gpus"],
                 resources=scenario["resources"])
    try:
        h = start()
        model = ray.get(h.model.state.remote())
        texts = [f"text {i} " * 10 for i in range(16)]
        with ThreadPoolExecutor(12) as pool:   # far more callers than the embedder admits
            list(pool.map(lambda i: ray.get(h.embedder.embed.remote(texts)), range(12)))
        embedder = ray.get(h.embedder.state.remote())
        placed = {"model": {"device": model["device"], "resources": model["ray_resources"]},
                  "embedder": {"device": embedder["device"], "resources": embedder["ray_resources"],
                               "peak_in_flight": embedder["peak_in_flight"]}}
        if scenario.get("then_hold_gpus"):
            placed |= refused_start(h, scenario["then_hold_gpus"])
        print(json.dumps(placed))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
