"""BENCHMARKS.md's tables as `benchmarks/render.py` writes them from the records: a table names
its command and host once, above it, not in every row (a reader scans figures, not repeats)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import render  # noqa: E402 (benchmarks/ is not a package)

HOST = {"arch": "x86_64", "cpu": "Intel(R) Xeon(R) Processor", "capability": "AVX512", "cores": 2}


def record(rows: list[dict], name: str = "bench") -> dict:
    return {"section": "s", "name": name, "command": f".venv/bin/python benchmarks/{name}.py",
            "date": "2026-12-01 10:00 UTC", "quick": False, "note": "beside other work", "load": 1.5,
            "host": HOST, "rows": rows}


def row(figure: str, measured: str, goal: str = "", met: bool | None = None, **on) -> dict:
    return {"figure": figure, "measured": measured, "goal": goal, "met": met,
            "threads": on.get("threads"), "dtype": on.get("dtype"), "engine": on.get("engine")}


def test_a_table_names_its_command_and_host_once_above_its_rows():
    text = render.section_table([record([row("step", "40 ms", threads=2, dtype="float32"),
                                         row("load", "0.4 s", threads=2, dtype="float32")])])
    caption, blank, header, _, *rows = text.splitlines()
    assert caption == ("`.venv/bin/python benchmarks/bench.py` · Xeon · AVX512 · 2 cores, 2 thr, float32"
                       " · 2026-12-01 10:00 UTC, load 1.5, beside other work")
    assert blank == "" and header == "| figure | measured |"
    assert rows == ["| step | 40 ms |", "| load | 0.4 s |"]


def test_what_rows_do_not_share_is_a_column_and_a_goal_shows_where_a_row_has_one():
    text = render.section_table([record([row("step", "40 ms", "≤ 50 ms", True, dtype="bfloat16"),
                                         row("swap", "1 ms")], name="a"),
                                 record([], name="b")])
    first, second = text.split("\n\n`")
    assert "| figure | goal | measured | ran on |" in first
    assert "| step | ≤ 50 ms: **met** | 40 ms | bfloat16 |" in first and "| swap | – | 1 ms |  |" in first
    assert second.startswith(".venv/bin/python benchmarks/b.py` ·")


def test_benchmarks_md_is_what_render_writes_from_the_records():
    """Nobody hand-edits a generated block: rendering the file again changes nothing."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert render.render(text, render.load()) == text


def test_a_suite_row_takes_pytests_summary_though_make_prints_after_it():
    import suite_time

    out = ("....\n908 passed, 2 skipped, 1 warning in 490.11s (0:08:10)\n"
           "make[1]: Leaving directory '/tmp/uniun-suite-x/clone'\n")
    assert suite_time.pytest_summary(out) == "908 passed, 2 skipped, 1 warning in 490.11s (0:08:10)"
    assert suite_time.pytest_summary("3 failed, 5 passed, 20 errors in 9.5s\n") == "3 failed, 5 passed, 20 errors in 9.5s"
    assert suite_time.pytest_summary("make: *** [test] Error 2\n") == "make: *** [test] Error 2"
    assert suite_time.pytest_summary("") == "no output"
