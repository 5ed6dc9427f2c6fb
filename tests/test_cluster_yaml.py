"""cluster.yaml, offline: Ray's own preparation and schema validation (what `ray up` runs
before it contacts any node), and the project's invariants: RAY_AUTH_MODE explicit wherever
Ray starts, the dashboard on 127.0.0.1, the stand-in device resources, no `ray stop`."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from uniun_ray.runtime.head import gpu_count, stand_in_resources
from uniun_ray.runtime.placement import DEVICE_RESOURCE, EMBEDDER_RESOURCE

CLUSTER_YAML = Path(__file__).parent.parent / "cluster.yaml"
RESOURCES = '--resources="$(python -m uniun_ray.runtime.head)"'


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_ray_prepares_and_validates_it(config):
    prepared = prepare_config(config)
    validate_config(prepared)  # raises on a schema error
    assert prepared["provider"]["type"] == "local"
    assert prepared["max_workers"] == len(config["provider"]["worker_ips"]) == 2


def start_commands(config) -> dict[str, str]:
    return {"head": " ".join(config["head_start_ray_commands"]),
            "worker": " ".join(config["worker_start_ray_commands"])}


def test_auth_mode_is_explicit_where_ray_starts(config):
    for role, commands in start_commands(config).items():
        modes = re.findall(r"RAY_AUTH_MODE=(\w+)", commands)
        assert modes and set(modes) <= {"token", "disabled"}, role
        assert commands.index("RAY_AUTH_MODE=") < commands.index("ray start"), role
        if "token" in modes:  # every node needs the token
            assert "~/.ray/auth_token" in config["file_mounts"]


def test_head_dashboard_binds_to_localhost(config):
    head = start_commands(config)["head"]
    assert "ray start --head" in head and "--dashboard-host=127.0.0.1" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head  # ray up's monitor needs it


def test_nodes_declare_their_stand_in_resources(config):
    for role, commands in start_commands(config).items():
        assert RESOURCES in commands, role
        assert 'PATH="$HOME/uniun-ray/.venv/bin:$PATH"' in commands, role  # that python has uniun_ray
    # what the command prints, mirroring the actors' placement (placement.py)
    assert stand_in_resources(0) == {DEVICE_RESOURCE: 1, EMBEDDER_RESOURCE: 1}
    assert stand_in_resources(1) == {EMBEDDER_RESOURCE: 1}
    assert stand_in_resources(2) == {}
    printed = subprocess.run([sys.executable, "-m", "uniun_ray.runtime.head"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    assert json.loads(printed) == stand_in_resources(gpu_count())  # whatever GPUs this host has


def test_setup_installs_the_project_and_nothing_runs_ray_stop(config):
    assert any("make install" in command for command in config["setup_commands"])
    every = [c for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands") for c in config[key]]
    assert not any("ray stop" in command for command in every)


def test_the_head_notices_a_dead_node_as_fast_as_uniun_ray_up_s(config):
    """The GCS's health checks decide how soon a dead node's devices leave the pool (issue 29):
    cluster.yaml's head sets what `uniun-ray up` sets."""
    from uniun_ray.runtime.head import NODE_HEALTH

    head = start_commands(config)["head"]
    assert all(f"{name}={value}" in head for name, value in NODE_HEALTH.items())
    assert head.index("RAY_health_check_period_ms") < head.index("ray start")
