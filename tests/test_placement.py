"""Placement that never hangs (issue 13): a plain `ray start --head` works as is (on the head of
tests/test_jobs.py, which is one), GPUs are used as SPEC §2 says, and a seat that is taken is
refused at once, naming the resource. GPUs are declared Ray-side (torch stays on the CPU:
UNIUN_TORCH_DEVICE=cpu), so every GPU placement path runs on this CPU machine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from uniun_ray.runtime import placement
from uniun_ray.runtime.placement import DEVICE_RESOURCE, EMBEDDER_RESOURCE, Seat
from uniun_ray.runtime.protocol import UniunError
from uniun_ray.settings import Settings

from conftest import spawn_scenario

SCENARIO = Path(__file__).parent / "placement_scenario.py"


def test_seats_follow_what_the_cluster_declares():
    plain, stand_ins = {"CPU": 2}, {"CPU": 2, DEVICE_RESOURCE: 1, EMBEDDER_RESOURCE: 1}
    one_gpu, two_gpus = {"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 2}
    assert placement.model_seat(plain) == Seat({}, "cpu") == placement.embedder_seat(plain)
    assert placement.model_seat(stand_ins) == Seat({"resources": {DEVICE_RESOURCE: 1}}, "cpu")
    assert placement.embedder_seat(stand_ins) == Seat({"resources": {EMBEDDER_RESOURCE: 1}}, "cpu")
    assert placement.model_seat(one_gpu) == Seat({"num_gpus": 1}, "cuda")
    assert placement.embedder_seat(one_gpu) == Seat({}, "cpu")          # the "separate device": the CPU
    assert placement.embedder_seat(two_gpus) == Seat({"num_gpus": 1}, "cuda")
    assert placement.embedder_seat(two_gpus, on_cpu=True) == Seat({}, "cpu")   # every GPU serves models
    assert placement.model_seat(two_gpus, forced="cpu").torch_device == "cpu"
    assert placement.device_name(one_gpu) == "gpu0" and placement.device_name(stand_ins) == "cpu0"


def test_the_pool_is_named_after_what_the_cluster_declares():
    assert placement.device_names({"CPU": 2}) == ["cpu0"]                                  # plain: the CPU
    assert placement.device_names({DEVICE_RESOURCE: 3, EMBEDDER_RESOURCE: 1}) == ["cpu0", "cpu1", "cpu2"]
    assert placement.device_names({"GPU": 1}) == ["gpu0"]
    assert placement.device_names({"GPU": 4, DEVICE_RESOURCE: 2}, embedder_gpus=1) == ["gpu0", "gpu1", "gpu2"]


def test_reconcile_adds_declared_capacity_and_removes_what_is_gone():
    four = {DEVICE_RESOURCE: 4}
    assert placement.reconcile(four, 0, ["cpu0", "cpu1"], []) == placement.PoolChange(add=("cpu2", "cpu3"))
    assert placement.reconcile(four, 0, ["cpu0", "cpu1", "cpu2", "cpu3"], []) == placement.PoolChange()
    # a node left with cpu1: it goes; its seat is declared no more, so nothing replaces it
    assert placement.reconcile({DEVICE_RESOURCE: 1}, 0, ["cpu0", "cpu1"], ["cpu1"]) == \
        placement.PoolChange(remove=("cpu1",))
    # killed for good while its seat stays declared: replaced under the lowest free name
    assert placement.reconcile({DEVICE_RESOURCE: 2}, 0, ["cpu0", "cpu1"], ["cpu0"]) == \
        placement.PoolChange(add=("cpu0",), remove=("cpu0",))
    # fewer seats than live devices: none is removed for it (which one left shows as its death)
    assert placement.reconcile({DEVICE_RESOURCE: 1}, 0, ["cpu0", "cpu1"], []) == placement.PoolChange()
    # a GPU node joins a cluster whose embedder took one GPU at start
    assert placement.reconcile({"GPU": 3}, 1, ["gpu0"], []) == placement.PoolChange(add=("gpu1",))


def test_a_taken_seat_is_refused_with_the_resource_and_the_command_that_adds_one():
    with pytest.raises(UniunError, match=r"needs 1 'GPU'.*`ray start --num-gpus=1`"):
        placement.check_free("model:gpu0", Seat({"num_gpus": 1}, "cuda"), {"GPU": 0.0, "CPU": 2})
    with pytest.raises(UniunError, match=r"needs 1 'uniun_device'.*--resources='\{\"uniun_device\": 1\}'"):
        placement.check_free("model:cpu0", Seat({"resources": {DEVICE_RESOURCE: 1}}, "cpu"), {})
    placement.check_free("embedder", Seat({}, "cpu"), {})                # a CPU seat is always free


def test_placement_settings_are_checked_where_the_runtime_starts():
    assert Settings.load({}).torch_device is None and Settings.load({"UNIUN_TORCH_DEVICE": "cpu"}).torch_device == "cpu"
    with pytest.raises(ValueError, match=r"UNIUN_TORCH_DEVICE='tpu' is not allowed: use one of cpu, cuda"):
        Settings.load({"UNIUN_TORCH_DEVICE": "tpu"})
    assert Settings.load({}).embedder_device == "gpu" and Settings.load({"UNIUN_EMBEDDER_DEVICE": "cpu"}).embedder_device == "cpu"
    with pytest.raises(ValueError, match=r"UNIUN_EMBEDDER_DEVICE='tpu' is not allowed: use one of cpu, gpu"):
        Settings.load({"UNIUN_EMBEDDER_DEVICE": "tpu"})
    assert Settings.load({}).embed_concurrency == 2
    assert Settings.load({"UNIUN_EMBED_CONCURRENCY": "3"}).embed_concurrency == 3
    with pytest.raises(ValueError, match=r"UNIUN_EMBED_CONCURRENCY='0' is not allowed: use a concurrency: an integer >= 1"):
        Settings.load({"UNIUN_EMBED_CONCURRENCY": "0"})


#: Each scenario needs a private cluster with other resources than the session's: a subprocess.
#: Two GPUs (the embedder gets one of its own) is the seat rule above; on Ray it takes the same
#: path as the model's GPU here, and another cluster costs the suite ~20 s. A plain head needs no
#: cluster of its own: tests/test_jobs.py runs this scenario on its `ray start` head.
SCENARIOS = {"one gpu, then taken": {"num_gpus": 1, "then_hold_gpus": 1}}


def launch(name: str):
    """Start the scenario `name` (conftest's `scenario_result`)."""
    return spawn_scenario(SCENARIO, json.dumps({"resources": {}, **SCENARIOS[name]}),
                          env={"UNIUN_TORCH_DEVICE": "cpu"})


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario("one gpu, then taken")
def test_one_gpu_takes_the_model_the_embedder_stays_on_the_cpu_and_a_taken_gpu_fails_fast(scenario_result):
    placed = scenario_result("one gpu, then taken")
    assert placed["model"]["resources"] == {"GPU": 1.0} and placed["model"]["device"] == "cpu"  # forced
    assert placed["embedder"]["resources"] == {} and placed["embedder"]["peak_in_flight"] == 2  # the default
    # then another job holds the GPU: start() refuses at once, naming it, instead of waiting for ever
    assert "needs 1 'GPU'" in placed["error"] and "ray start --num-gpus=1" in placed["error"]
    assert placed["after_s"] < 8      # the grace for a seat freed a moment ago (3 s), then the refusal


def fake_cluster(monkeypatch, device, create, cluster: dict) -> None:
    """The SchedulerActor's Ray around it, faked: its devices are `device(name)`, it makes an
    actor with `create(fleet, device, resources)`, the cluster declares `cluster["declared"]`
    with `cluster["free"]` free, and no GCS publishes nodes."""
    import asyncio

    import ray

    from uniun_ray.runtime import actors

    monkeypatch.setattr(actors, "RayDevice", device)
    monkeypatch.setattr(actors.ModelFleet, "create", create)
    monkeypatch.setattr(actors.SchedulerActor, "_follow_nodes", lambda self: asyncio.sleep(0))
    monkeypatch.setattr(ray, "cluster_resources", lambda: cluster["declared"])
    monkeypatch.setattr(ray, "available_resources", lambda: cluster["free"])


def test_the_scheduler_applies_reconcile_gone_idle_devices_leave_free_seats_get_actors(monkeypatch, tmp_path):
    """The thin shell over `reconcile` (SchedulerActor.watch_pool), with fake model actors
    (alive while their name is held) and a cluster that declares stand-in seats."""
    import asyncio

    from conftest import FakeDevice, lease_of, spec
    from uniun_ray.settings import EngineSettings
    from uniun_ray.runtime import actors
    from uniun_ray.runtime.service import RuntimeConfig

    named, made = {"model:cpu0", "model:cpu1"}, []
    cluster = {"declared": {DEVICE_RESOURCE: 3}, "free": {DEVICE_RESOURCE: 1}}

    class NamedActor(FakeDevice):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        async def alive(self) -> bool:
            return self.name in named

        async def locate(self) -> None:
            return None

    def create(fleet, device, resources):
        named.add(f"model:{device}")
        made.append(device)

    fake_cluster(monkeypatch, NamedActor, create, cluster)

    async def go():
        s = actors.SchedulerActor(["cpu0", "cpu1"], actors.ModelFleet(EngineSettings()),
                                  RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        await s.submit(spec("n", "nataraj"))
        assert (await lease_of(s, "n")).device == "cpu0"
        named.discard("model:cpu1")                       # idle, killed for good
        first = await s.watch_pool()
        named.discard("model:cpu0")                       # busy: it leaves through its job's path
        second = await s.watch_pool()
        # a scheduler restarted with its first pool: an actor made since is found, not made
        cluster.update(declared={DEVICE_RESOURCE: 4}, free={})
        named.add("model:cpu3")
        third = await s.watch_pool()
        return first, second, third, s.policy.devices
    first, second, third, pool = asyncio.run(asyncio.wait_for(go(), 10))
    assert first == {"removed": ["cpu1"], "added": ["cpu1"], "waiting": ["cpu2"]}   # its seat is free again: a new actor
    assert second == {"removed": [], "added": ["cpu2"], "waiting": []}
    assert third == {"removed": [], "added": ["cpu3"], "waiting": []} and pool == ("cpu0", "cpu1", "cpu2", "cpu3")
    assert made == ["cpu1", "cpu2"]


def test_a_node_that_dies_takes_its_devices_out_of_the_pool_and_one_that_joins_adds_its_own(monkeypatch, tmp_path):
    """The scheduler's side of Ray's node events (`SchedulerActor.node_changed`), with fake
    model actors that know their node: a dead node's devices leave at once, busy ones too (the
    job goes back and runs on a surviving device), and their actors are killed for good (no
    look at the cluster adopts them meanwhile, even one that still counts the node's seats); a
    node that joins gets a device per seat it declares."""
    import asyncio

    from conftest import FakeDevice, lease_of, spec
    from uniun_ray.settings import EngineSettings
    from uniun_ray.runtime import actors
    from uniun_ray.events.log import read
    from uniun_ray.runtime.nodes import Node
    from uniun_ray.runtime.service import RuntimeConfig

    where = {"model:cpu0": "head", "model:cpu1": "w1", "model:cpu2": "w1"}
    retired, cluster, killing = [], {"declared": {DEVICE_RESOURCE: 3}, "free": {}}, asyncio.Event()

    class PlacedActor(FakeDevice):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name, self.node = name, where.get(name)

        async def alive(self) -> bool:
            return self.name in where

        async def locate(self) -> str | None:
            return self.node

        async def retire(self) -> None:
            retired.append(self.name)
            await killing.wait()                          # Ray takes its time
            where.pop(self.name)

    def create(fleet, device, resources):
        where[f"model:{device}"] = "w2"

    fake_cluster(monkeypatch, PlacedActor, create, cluster)

    async def go():
        s = actors.SchedulerActor(["cpu0", "cpu1", "cpu2"], actors.ModelFleet(EngineSettings()),
                                  RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        for job, kind in (("g", "gana"), ("n", "nataraj"), ("m", "nataraj")):
            await s.submit(spec(job, kind))
        leases = {job: await lease_of(s, job) for job in ("g", "n", "m")}
        assert {j: lease.device for j, lease in leases.items()} == {"g": "cpu0", "n": "cpu1", "m": "cpu2"}
        await s.release("m", leases["m"].epoch, "done")       # cpu2 idle, cpu1 busy with n
        assert await s.node_changed(Node("w1", "10.0.0.2", alive=True)) == {"added": [], "removed": [],
                                                                            "waiting": []}
        dying = asyncio.ensure_future(s.node_changed(Node("w1", "", alive=False, death="died unexpectedly")))
        await asyncio.sleep(0.01)                            # as Ray words it: the id, no address
        assert s.policy.devices == ("cpu0",) and retired == ["model:cpu1", "model:cpu2"]   # out before the kill
        assert await s.watch_pool() == {"added": [], "removed": [], "waiting": ["cpu1", "cpu2"]}  # not adopted
        killing.set()
        assert await dying == {"added": [], "removed": ["cpu1", "cpu2"]}
        cluster.update(declared={DEVICE_RESOURCE: 1})
        assert s.policy.devices == ("cpu0",) and await s.device_lost("n", leases["n"].epoch, "node died") is True
        await s.release("g", leases["g"].epoch, "done")
        assert (await lease_of(s, "n")).device == "cpu0"         # n resumes on the surviving device
        cluster.update(declared={DEVICE_RESOURCE: 2}, free={DEVICE_RESOURCE: 1})
        joined = await s.node_changed(Node("w2", "10.0.0.3", alive=True))
        again = await s.node_changed(Node("w2", "10.0.0.3", alive=True))   # the same news twice
        return joined, again, s.policy.devices
    joined, again, devices = asyncio.run(asyncio.wait_for(go(), 10))
    assert joined == {"added": ["cpu1"], "removed": [], "waiting": []} and where["model:cpu1"] == "w2"
    assert again == {"added": [], "removed": []} and devices == ("cpu0", "cpu1")
    events = read(tmp_path / "ev.jsonl")
    assert [(e["node"], e["address"], e["change"]) for e in events if e["ev"] == "node"] == \
        [("w1", "10.0.0.2", "joined"), ("w1", "10.0.0.2", "left"), ("w2", "10.0.0.3", "joined")]
    removed = [e["reason"] for e in events if e["ev"] == "device" and e["change"] == "removed"]
    assert removed == ["its node 10.0.0.2 (w1) died unexpectedly"] * 2


def test_nodes_read_from_ray_s_node_table_and_its_published_changes():
    from ray.core.generated import gcs_pb2

    from uniun_ray.runtime.nodes import Node, describe, from_info, from_row

    dead = gcs_pb2.GcsNodeInfo(node_id=bytes.fromhex("ab" * 28), node_manager_address="10.0.0.2",
                               state=gcs_pb2.GcsNodeInfo.DEAD)
    dead.death_info.reason = 2
    dead.death_info.reason_message = "missed too many heartbeats\nmore"
    assert from_info(dead) == Node("ab" * 28, "10.0.0.2", False, False,
                                   "died unexpectedly (its raylet stopped answering): missed too many heartbeats")
    head = from_row({"NodeID": "cd" * 28, "NodeManagerAddress": "10.0.0.1", "Alive": True,
                     "Resources": {"CPU": 2.0, "node:__internal_head__": 1.0}})
    assert head == Node("cd" * 28, "10.0.0.1", True, True)
    worker = Node("ef" * 28, "10.0.0.3", True)
    assert describe([worker, from_info(dead), head], {"cpu0": head.id, "cpu1": worker.id, "cpu2": None}) == [
        {"node": head.id, "address": "10.0.0.1", "head": True, "devices": ["cpu0"]},
        {"node": worker.id, "address": "10.0.0.3", "head": False, "devices": ["cpu1"]}]
