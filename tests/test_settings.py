"""One source of truth for settings and memory (issue 44): every UNIUN_* setting is declared once
(settings.SETTINGS) and read from the environment there only, checked where the runtime starts
with errors that name the variable, its value and what it takes, shown with its source by
`uniun-ray config` and the scheduler's `status`, and tabled in docs/configuration.md from the
declarations. Each device's memory is divided by one plan (uniun_ray.memory), tested here
without torch but for the engine's own use of it."""
from __future__ import annotations

import ast
import asyncio
import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from rich.console import Console

from uniun_ray import cli
from uniun_ray.memory import MB, Device, MemoryShort, plan
from uniun_ray.observe.statusview import render
from uniun_ray.runtime.service import RuntimeConfig, SchedulerService
from uniun_ray.settings import SETTING, SETTINGS, EngineSettings, Settings, markdown_table

from conftest import FakeDevice
from test_models import tiny_cache  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
GB = 2**30


def environment_reads(path: Path) -> list[str]:
    """The UNIUN_* variables a module reads from the environment (``os.environ[...]``, its
    ``get``/``setdefault``/``pop``, ``os.getenv``), named by a literal or a constant of the module;
    a key that is another module's ``*_ENV`` constant counts too."""
    tree = ast.parse(path.read_text())
    constants = {target.id: node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}

    def key(expr: ast.expr) -> str:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""
        return constants.get(name) or (f"UNIUN_? ({name})" if name.endswith("_ENV") else "")

    def environ(expr: ast.expr) -> bool:
        return isinstance(expr, ast.Attribute) and expr.attr == "environ" or isinstance(expr, ast.Name) and expr.id == "environ"

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and environ(node.value):
            keys.append(key(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                node.func.attr in ("get", "setdefault", "pop") and environ(node.func.value) or node.func.attr == "getenv"):
            keys.append(key(node.args[0]))
    return sorted(k for k in keys if k.startswith("UNIUN_"))


def test_no_module_but_settings_reads_a_uniun_variable_from_the_environment(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nfrom x import CACHE_ENV\nROWS_ENV = "UNIUN_KV_ROWS"\nos.environ.get(ROWS_ENV, "")\n'
                      'os.getenv("UNIUN_SLOTS")\nos.environ[CACHE_ENV]\nos.environ.get("RAY_ADDRESS")\n')
    assert environment_reads(sample) == ["UNIUN_? (CACHE_ENV)", "UNIUN_KV_ROWS", "UNIUN_SLOTS"]
    readers = {str(path.relative_to(ROOT)): environment_reads(path) for path in sorted((ROOT / "uniun_ray").rglob("*.py"))
               if path != ROOT / "uniun_ray" / "settings.py"}
    assert {path: names for path, names in readers.items() if names} == {}


def test_every_setting_is_declared_once_and_the_engine_takes_its_defaults_from_there():
    assert len({s.name for s in SETTINGS}) == len({s.env for s in SETTINGS}) == len(SETTINGS)
    assert all(s.env.startswith("UNIUN_") and s.doc for s in SETTINGS)
    for each in fields(EngineSettings):
        assert getattr(EngineSettings(), each.name) == SETTING[each.name].default, each.name
    assert {s.env for s in SETTINGS if s.debug} == {"UNIUN_KV_ROWS", "UNIUN_KV_STEPS", "UNIUN_TORCH_DEVICE"}


BAD = {"UNIUN_SLOTS": "0", "UNIUN_ENGINE": "llama", "UNIUN_WARM_START": "yes", "UNIUN_DTYPE": "fp8",
       "UNIUN_THREADS": "0", "UNIUN_MEMORY": "lots", "UNIUN_KV_CACHE_MB": "-1", "UNIUN_KV_OFFLOAD_MB": "1e3",
       "UNIUN_WARM_MB": "half", "UNIUN_CORESIDENT": "2", "UNIUN_MAX_MEMORY": "6GiB", "UNIUN_KV_ROWS_MB": "1.5",
       "UNIUN_KV_ROWS": "paged", "UNIUN_KV_STEPS": "fast", "UNIUN_HUB_KERNELS": "true",
       "UNIUN_DETERMINISTIC": "on", "UNIUN_TORCH_DEVICE": "tpu", "UNIUN_EMBEDDER_DEVICE": "npu",
       "UNIUN_EMBED_CONCURRENCY": "0", "UNIUN_MODELS": "tiny"}


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.env in BAD], ids=lambda s: s.env)
def test_a_bad_value_is_refused_naming_the_variable_its_value_and_what_it_takes(setting):
    with pytest.raises(ValueError) as refused:
        Settings.load({setting.env: BAD[setting.env]})
    assert str(refused.value) == f"{setting.env}={BAD[setting.env]!r} is not allowed: use {setting.kind.allowed}"


def test_each_value_says_where_it_came_from():
    settings = Settings.load({"UNIUN_DTYPE": "float32", "UNIUN_SLOTS": "3", "UNIUN_MEMORY": "0.5"},
                             flags={"slots": "auto", "engine": None})
    assert (settings.dtype, settings.slots, settings.memory, settings.engine) == ("float32", None, 0.5, "transformers")
    assert (settings.sources["dtype"], settings.sources["slots"], settings.sources["engine"]) == \
        ("environment", "flag", "default")
    given = settings.given(chat_model="tiny", slots=None)
    assert given.chat_model == "tiny" and given.sources["chat_model"] == "argument" and given.sources["slots"] == "flag"
    assert Settings.load({"UNIUN_MEMORY": "12GiB"}).memory == 12 * GB
    assert Settings.load({"UNIUN_KV_ROWS_MB": "64"}).engine_settings.kv_rows_mb == 64   # handed down to the engine
    with pytest.raises(ValueError, match=r"chat_model \(UNIUN_CHAT_MODEL\) must be a model id or a folder"):
        settings.given(chat_model="")


def test_uniun_ray_config_prints_every_setting_and_its_source(monkeypatch, capsys):
    for setting in SETTINGS:
        monkeypatch.delenv(setting.env, raising=False)
    monkeypatch.setenv("UNIUN_DTYPE", "float32")
    monkeypatch.setenv("UNIUN_API_KEY", "s3cret")
    assert cli.main(["config", "--slots", "4"]) == 0
    out = capsys.readouterr().out
    *table, plan_line = out.splitlines()
    lines = {line.split()[0]: line.split()[1:] for line in table}
    assert set(lines) == {s.env for s in SETTINGS}
    assert plan_line.startswith("memory plan of a CPU device here: budget ") and "prefix_cache -/1024" in plan_line
    assert lines["UNIUN_DTYPE"] == ["float32", "environment"] and lines["UNIUN_SLOTS"] == ["4", "flag"]
    assert lines["UNIUN_ENGINE"] == ["transformers", "default"] and lines["UNIUN_KV_ROWS"] == ["auto", "default", "(debug)"]
    assert lines["UNIUN_API_KEY"] == ["(set)", "environment"] and "s3cret" not in out
    assert cli.main(["config", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {"setting": "UNIUN_DTYPE", "value": "float32", "source": "environment", "debug": False} in shown["settings"]
    assert shown["cpu_memory_plan"]["parts"]["prefix_cache"]["planned_mb"] == 1024
    monkeypatch.setenv("UNIUN_KV_CACHE_MB", str(10**9))
    assert cli.main(["config"]) == 2
    assert "the device's memory plan does not fit: UNIUN_KV_CACHE_MB=1000000000" in capsys.readouterr().err
    monkeypatch.setenv("UNIUN_THREADS", "many")
    assert cli.main(["config"]) == 2
    assert "UNIUN_THREADS='many' is not allowed: use a thread count: an integer >= 1" in capsys.readouterr().err


def test_status_shows_the_settings_the_runtime_was_started_with():
    rows = tuple(Settings.load({"UNIUN_SLOTS": "2"}).describe())

    async def go():
        return await SchedulerService(FakeDevice(), RuntimeConfig(settings=rows)).status()
    snapshot = asyncio.run(asyncio.wait_for(go(), 10))
    assert {"setting": "UNIUN_SLOTS", "value": "2", "source": "environment", "debug": False} in snapshot["settings"]
    assert len(snapshot["settings"]) == len(SETTINGS)
    snapshot["devices"][0]["engine"] = {"memory": plan(CPU, EngineSettings(), weights=500 * MB).describe({"weights": 500 * MB})}
    console = Console(record=True, width=200)
    console.print(render(snapshot))
    text = console.export_text()
    assert re.search(r"settings +UNIUN_SLOTS=2 \(environment\)", text), text
    assert re.search(r"memory dev0 +budget 8192 MB: weights 500/500, warm -/4096, prefix_cache -/1024", text), text


def test_the_configuration_page_holds_the_table_made_from_the_settings():
    page = (ROOT / "docs" / "configuration.md").read_text()
    begin, end = "<!-- settings-table:begin -->\n", "\n<!-- settings-table:end -->"
    assert page[page.index(begin) + len(begin):page.index(end)] == markdown_table(), \
        "docs/configuration.md: paste settings.markdown_table() between the markers"


# -- one memory plan per device -----------------------------------------------------------------
CPU = Device("cpu", memory=8 * GB, host=8 * GB)
GPU = Device("cuda", memory=80 * GB, host=32 * GB)


def test_a_cpu_plan_keeps_the_defaults_of_before():
    """1 GiB of prefix cache, half the device's share of the host for idle models, the static
    rows' 1 GiB only where static rows are chosen, no offload tier."""
    empty = plan(CPU, EngineSettings())
    assert (empty.budget, empty.prefix_cache, empty.warm, empty.kv_rows, empty.offload) == (8 * GB, GB, 4 * GB, 0, 0)
    loaded = plan(CPU, EngineSettings(), weights=500 * MB, static_rows=True)
    assert (loaded.weights, loaded.kv_rows, loaded.warm) == (500 * MB, GB, 4 * GB)
    assert loaded.weights + loaded.kv_rows + loaded.prefix_cache + loaded.warm + loaded.headroom == loaded.budget
    small = plan(Device("cpu", 3 * GB, 3 * GB), EngineSettings(), weights=GB, check=False)
    assert small.warm == GB and small.headroom == 0     # what the other parts leave, not half of the budget


def test_a_gpu_plan_gives_the_rows_what_the_weights_idle_models_and_prefix_cache_leave():
    gpu = plan(GPU, EngineSettings(), weights=16 * GB, coresident=4 * GB, static_rows=True)
    spare = 80 * GB - 16 * GB - 4 * GB - 4 * GB
    assert (gpu.prefix_cache, gpu.offload, gpu.warm) == (4 * GB, 4 * GB, 16 * GB)
    assert gpu.kv_rows == int(spare * 0.85) and gpu.headroom == spare - gpu.kv_rows
    assert plan(GPU, EngineSettings(memory=0.5)).budget == 40 * GB
    assert plan(GPU, EngineSettings(memory=12 * GB, kv_rows_mb=1024), static_rows=True).kv_rows == GB
    assert plan(GPU, EngineSettings(kv_cache_mb=0)).offload == 0   # no cache, no second tier


def test_settings_that_ask_for_more_than_the_device_has_are_refused_naming_them():
    with pytest.raises(MemoryShort, match=r"UNIUN_KV_CACHE_MB=6000, UNIUN_WARM_MB=4000 come to 10000.0 MB, "
                                          r"more than its budget of 8192.0 MB \(UNIUN_MEMORY=unset\)"):
        plan(CPU, EngineSettings(kv_cache_mb=6000, warm_mb=4000))
    with pytest.raises(MemoryShort, match=r"UNIUN_KV_ROWS_MB=50000 come to .* budget of 40960.0 MB \(UNIUN_MEMORY=0.5\)"):
        plan(GPU, EngineSettings(memory=0.5, kv_rows_mb=50000))
    plan(CPU, EngineSettings(kv_cache_mb=4000, warm_mb=4000))   # 8000 MB fit
    busy = plan(Device("cpu", 900 * MB, 900 * MB), EngineSettings())   # a default is never refused
    assert (busy.prefix_cache, busy.warm, busy.headroom) == (GB, 0, 0)


def test_the_engine_plans_its_device_and_shows_the_plan_planned_and_used(tiny_cache):  # noqa: F811
    from uniun_ray.models import Engine

    with pytest.raises(MemoryShort, match="UNIUN_KV_CACHE_MB=100000000"):
        Engine(settings=EngineSettings(kv_cache_mb=100_000_000))
    engine = Engine(settings=EngineSettings(dtype="float32", kv_rows="static", kv_rows_mb=16))
    engine.load("tiny")
    parts = engine.describe()["memory"]["parts"]
    assert parts["kv_rows"]["planned_mb"] == 16 and 0 < parts["kv_rows"]["used_mb"] <= 16
    assert parts["weights"]["planned_mb"] == parts["weights"]["used_mb"] > 0
    assert parts["prefix_cache"]["planned_mb"] == 1024 and engine.resident.rows.bytes <= 16 * MB

