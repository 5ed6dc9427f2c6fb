"""The project on a GPU, against transformers' static-cache compiled `generate` and the roofline (issue 36).

    python3 benchmarks/gpu_bench.py [--shapes llama-1b,llama-8b,smollm2-135m] [--rows 1,2,4,8,16,32,64]
                                    [--budget 420] [--device cuda]
    python3 benchmarks/gpu_bench.py --device cpu --shapes tiny --tokenizer tiny --rows 1,2   # a dry run
    python3 benchmarks/gpu_bench.py --plan                                                  # what would run
    python3 benchmarks/gpu_bench.py --quick                                    # the 1B shape at 1 and 64 rows

`make gpu-check` runs it on a lent GPU machine, which has no package registry and no Ray: it
imports neither Ray nor anything it would have to install. Per named shape (``gpu_shapes``:
seeded random weights, SmolLM2's tokenizer, made in a temporary folder) it records:

* the load through the project's own ``Engine``, and what ``describe()`` reports of graph
  capture (time, memory) and of the determinism setting, where it reports them;
* the project's decode step at each row count: a ``Batch`` of N requests of a 256-token prompt
  each (``gpu_anchor.prompt_ids``: the anchor reads the same), their prefills interleaved with
  the others' steps as always; once all N decode, up to 128 steps are timed (steady decode,
  no prefill). Rows join one per step (``prefill_chunk`` = the prompt: one pass each), so each
  asks for as many more tokens as the fill and the chat take: no row leaves while timed;
* transformers' static-cache compiled ``generate`` at the same rows and lengths (the anchor,
  ``gpu_anchor``), in a process of its own after the project's engine is unloaded;
* the roofline: the weights' bytes over the HBM bandwidth (``--hbm-tbps``, an H200's 4.8);
* a chat's TTFT (256-token prompt, not revocable) alone, and beside full slots: at
  ``--chat-rows`` rows one is revoked, as the scheduler does for a chat (R22), and the chat joins
  the others; with its tokens' pace beside and alone (R23).

``--budget`` trims the plan to fit: the goals' points (the 1B and 8B shapes at 1 and 64 rows,
project and anchor, the chat) are always planned, the others as far as their estimated costs
fit beside them (the anchor's compile dominates); as it runs, a point is skipped, the reason
recorded, when the time left would not cover it and the better-ranked points after it, by
estimates revised from what the run has measured. The record (``record.py``, section "GPU",
named ``gpu_bench-gpu`` on a GPU) keeps the rows BENCHMARKS.md shows and, under "detail",
everything measured; ``$OUT/gpu_bench-progress.json`` holds that detail as the run goes (what a
time limit leaves).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_shapes  # noqa: E402
from gpu_anchor import prompt_ids, sync  # noqa: E402
from record import RESULTS, ROOT, Record  # noqa: E402

from uniun_ray.models import Batch, Engine, GenerateRequest, materialize, resolve  # noqa: E402
from uniun_ray.settings import EngineSettings  # noqa: E402
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL  # noqa: E402

ANCHOR = Path(__file__).resolve().parent / "gpu_anchor.py"
LABELS = {"llama-1b": "1B Llama shape", "llama-8b": "8B Llama shape", "smollm2-135m": "SmolLM2-135M",
          "tiny": "tiny shape"}
#: Shapes whose goals (issue 36) the rows are judged by, in the order their points are kept.
GOAL_SHAPES = ("llama-1b", "llama-8b")
RATIO_GOAL, CHAT_TTFT_GOAL_S, CHAT_PACE_GOAL = 1.25, 0.050, 1.25
MIN_STEPS = 8                    # timed steps of a point, at least, however short its time box
CHAT_ROW = 1_000_000             # the chat's prompt is prompt_ids of this row: no batch row shares it


@dataclass
class Point:
    shape: str
    kind: str                    # "project" (the engine's Batch) or "anchor" (transformers' generate)
    rows: int
    key: bool                    # a goal's point: kept first


class Budget:
    """The run's seconds: what each point is expected to cost (revised from what the run
    measures: the project's step, the anchor's compile), the plan that fits, the time left."""

    def __init__(self, args, vocabulary: int) -> None:
        self.args, self.vocabulary = args, vocabulary
        self.step_s, self.compile_s = args.step_guess, args.compile_guess if args.device == "cuda" else 0.0
        self.started = time.monotonic()

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def setup(self, shape: str) -> float:
        """Making the weights and loading them (the engine, then the anchor's process)."""
        return 8 + gpu_shapes.parameters(shape, self.vocabulary) * (6e-9 if self.args.device == "cuda" else 2e-8)

    def cost(self, point: Point) -> float:
        a = self.args
        if point.kind == "anchor":
            return self.compile_s + 2 * a.new_tokens * 0.02 + 2
        chat = 2 * a.chat_tokens * self.step_s if point.rows == chat_rows(a) else 0
        return self.step_s * (point.rows + 2) + min(a.point_s, a.new_tokens * self.step_s) + chat + 1

    def trim(self, points: list[Point]) -> tuple[list[Point], list[Point]]:
        """The goals' points and the others that fit beside them, in the order they run (shape by
        shape), and the rest. A goal's point is never trimmed on an estimate: the run skips it
        only if, when its turn comes, what the run has measured says it no longer fits."""
        kept = [point for point in points if point.key]
        for point in sorted(points, key=self.rank):
            if not point.key and self.need(kept + [point]) <= self.args.budget:
                kept.append(point)
        run = sorted(kept, key=lambda p: (self.args.shapes.index(p.shape), p.kind != "project", not p.key, p.rows))
        return run, [p for p in points if p not in kept]

    def affords(self, point: Point, later: list[Point], committed: float = 0.0) -> bool:
        """Whether ``point`` fits in the time left beside the better-ranked points after it (and
        ``committed`` seconds of points it runs with, e.g. in one anchor process)."""
        better = [p for p in later if self.rank(p) < self.rank(point)]
        return committed + self.need([point] + better, started={point.shape}) <= self.left()

    def need(self, points: list[Point], started: set = frozenset()) -> float:
        shapes = {p.shape for p in points} - set(started)
        return sum(map(self.cost, points)) + sum(map(self.setup, shapes))

    def rank(self, point: Point) -> tuple:
        return (not point.key, self.args.shapes.index(point.shape), point.kind != "project", point.rows)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="llama-1b,llama-8b,smollm2-135m", help=f"of {', '.join(gpu_shapes.SHAPES)}")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts of the project's Batch")
    ap.add_argument("--anchor-rows", help="row counts of the anchor (default: --rows; 1 and 64 are the goals')")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="the anchor's tokens; the project's timed steps, at most")
    ap.add_argument("--chat-rows", type=int, default=64, help="slots the chat joins full (one revoked for it)")
    ap.add_argument("--chat-tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run; the plan is trimmed to fit")
    ap.add_argument("--point-s", type=float, default=3.0, help="seconds of timed steps per project point, at most")
    ap.add_argument("--step-guess", type=float, default=0.1, help="a project step's seconds, for the plan")
    ap.add_argument("--compile-guess", type=float, default=45.0, help="the anchor's compile, seconds, for the plan")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the roofline (an H200's)")
    ap.add_argument("--tokenizer", help="a folder or model id whose tokenizer and vocabulary the shapes take "
                                        "(default: .gpu/tok from pack.sh, else the converted SmolLM2)")
    ap.add_argument("--models", help="where the shapes' folders are made (default: a temporary folder)")
    ap.add_argument("--kv-cache-mb", type=int, default=0, help="the engine's prefix cache (0: off; no prompt repeats)")
    ap.add_argument("--plan", action="store_true", help="print the trimmed plan and exit")
    ap.add_argument("--quick", action="store_true",
                    help="the 1B shape's goals only: 1 and 64 rows (`make bench QUICK=1`)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.rows = "llama-1b", "1,64"
    args.rows = [int(r) for r in args.rows.split(",")]
    args.anchor_rows = [int(r) for r in args.anchor_rows.split(",")] if args.anchor_rows else args.rows
    args.shapes = args.shapes.split(",")
    unknown = set(args.shapes) - set(gpu_shapes.SHAPES)
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(gpu_shapes.SHAPES)}")
    return args


# -- the plan ------------------------------------------------------------------------------------

def plan(args) -> list[Point]:
    """Every point asked for: the goals' (1 and 64 rows of the goal shapes) are key."""
    return [Point(shape, kind, rows, rows in (1, chat_rows(args)) and shape in GOAL_SHAPES)
            for shape in args.shapes
            for kind, counts in (("project", args.rows), ("anchor", args.anchor_rows)) for rows in counts]


def chat_rows(args) -> int:
    """The row count whose point the chat joins: --chat-rows, else the largest."""
    return args.chat_rows if args.chat_rows in args.rows else max(args.rows)


# -- the project ----------------------------------------------------------------------------------

def request(row: int, prompt_tokens: int, new_tokens: int, vocabulary: int) -> GenerateRequest:
    return GenerateRequest(prompt=prompt_ids(row, prompt_tokens, vocabulary), max_new_tokens=new_tokens,
                           temperature=0)


def decode_rows(engine, rows: int, args, vocabulary: int, chat: bool) -> dict:
    """The project's steady decode step with ``rows`` rows (then, if ``chat``, a chat beside them)."""
    batch = Batch(engine, slots=rows)
    cancels = [threading.Event() for _ in range(rows)]
    asked = args.new_tokens + rows + args.chat_tokens + 8     # the fill and the chat: no row leaves early
    for row, cancel in enumerate(cancels):
        batch.add(request(row, args.prompt_tokens, asked, vocabulary), cancel)
    started = time.perf_counter()
    while batch.rows < rows and batch.busy:
        batch.step()
    out = {"rows": rows, "fill_s": time.perf_counter() - started} | steady(batch, rows, args)
    if chat:
        out["chat_beside"] = chat_beside(batch, cancels[0], args, vocabulary)
    batch.close()
    return out


def steady(batch, rows: int, args) -> dict:
    """Time up to --new-tokens steps in which all ``rows`` decode (within --point-s, at least MIN_STEPS)."""
    times: list[float] = []
    while len(times) < args.new_tokens and (len(times) < MIN_STEPS or sum(times) < args.point_s):
        sync(args.device)
        started = time.perf_counter()
        batch.step()
        sync(args.device)
        if batch.last_step_rows != rows:
            break
        times.append(time.perf_counter() - started)
    if not times:
        return {"error": f"no step decoded all {rows} rows"}
    step = statistics.median(times)
    return {"step_ms": step * 1e3, "tok_s": rows / step, "timed_steps": len(times),
            "p90_step_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3}


def chat_beside(batch, revoked: threading.Event, args, vocabulary: int) -> dict:
    """One row revoked (its slot handed to the chat, R22), then a chat joins the rows left."""
    revoked.set()
    for _ in range(8):
        if batch.rows < batch.slots:
            break
        batch.step()
    busy = batch.rows
    return {"busy_rows": busy} | chat_run(batch, args, vocabulary)


def chat_alone(engine, args, vocabulary: int) -> dict:
    return chat_run(Batch(engine, slots=chat_rows(args)), args, vocabulary)


def chat_run(batch, args, vocabulary: int) -> dict:
    """A chat added to ``batch``, stepped until it ends: its TTFT (from add) and its tokens' pace."""
    chat = batch.add(request(CHAT_ROW, args.prompt_tokens, args.chat_tokens, vocabulary), threading.Event(),
                     revocable=False)
    while not chat.done.is_set():
        batch.step()
    result = chat.result
    pace = (result.total_s - result.ttft_s) / max(1, result.tokens - 1) if result.ttft_s is not None else None
    return {"ttft_ms": None if result.ttft_s is None else result.ttft_s * 1e3, "token_ms": pace and pace * 1e3,
            "tokens": result.tokens, "finish_reason": result.finish_reason}


def reported(described: dict, pattern: str) -> dict:
    """The entries of ``describe()`` (nested) whose key matches ``pattern``, by their path."""
    found = {}

    def walk(value, path: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                where = f"{path}.{key}" if path else str(key)
                if re.search(pattern, str(key), re.IGNORECASE):
                    found[where] = inner
                else:
                    walk(inner, where)
    walk(described, "")
    return found


class Run:
    """One run: the points still to come, the detail measured so far, shape by shape."""

    def __init__(self, args, budget: Budget, points: list[Point], tokenizer: Path, models: Path) -> None:
        self.args, self.budget, self.tokenizer, self.models = args, budget, tokenizer, models
        self.later = list(points)
        self.detail: dict = {"shapes": {}}

    def shape(self, shape: str) -> None:
        """Make the shape's weights, measure the project's points, then the anchor's."""
        args, points = self.args, [p for p in self.later if p.shape == shape]
        out = self.detail["shapes"][shape] = {"skipped": []}
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        started = time.perf_counter()
        folder = self.models / shape
        out["params"] = gpu_shapes.make(shape, self.tokenizer, folder, args.device, dtype)
        out["make_s"] = time.perf_counter() - started
        out["weight_bytes"] = out["params"] * (2 if dtype == "bfloat16" else 4)
        out["roofline_step_ms"] = out["weight_bytes"] / (args.hbm_tbps * 1e12) * 1e3
        vocabulary = self.budget.vocabulary     # the tokenizer's model's: prompts draw their ids below it
        log(shape, f"{out['params']:,} parameters, made in {out['make_s']:.1f} s")
        try:
            self.project(folder, [p for p in points if p.kind == "project"], vocabulary, out)
            self.keep()
            self.anchor(folder, [p for p in points if p.kind == "anchor"], vocabulary, out)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            self.keep()

    def project(self, folder: Path, points: list[Point], vocabulary: int, out: dict) -> None:
        """Load ``folder`` through the project's Engine, measure its points, unload it."""
        args = self.args
        settings = EngineSettings(dtype="bfloat16" if args.device == "cuda" else "float32", kv_cache_mb=args.kv_cache_mb)
        engine = Engine(args.device, settings, prefill_chunk=args.prompt_tokens)
        out["load_s"] = engine.load(str(folder)).seconds
        try:
            out["describe"] = engine.describe()
            out["capture"] = reported(out["describe"], r"graph|captur")
            out["determinism"] = reported(out["describe"], r"determin|invariant")
            chat_alone(engine, args, vocabulary)                              # a warm-up
            out["chat_alone"] = chat_alone(engine, args, vocabulary)
            out["project"] = []
            for point in points:
                if self.affords(point, out):
                    out["project"].append(self.decode(engine, point, vocabulary))
                    self.keep()
        finally:
            engine.unload()

    def decode(self, engine: Engine, point: Point, vocabulary: int) -> dict:
        try:
            result = decode_rows(engine, point.rows, self.args, vocabulary, chat=point.rows == chat_rows(self.args))
        except Exception as error:  # noqa: BLE001 - a row count that fails (memory) is a finding; go on
            result = {"rows": point.rows, "error": f"{type(error).__name__}: {error}"[:400]}
        self.budget.step_s = 1.5 * result.get("step_ms", 1e3 * self.budget.step_s) / 1e3
        log(point.shape, "project", result)
        return result

    def anchor(self, folder: Path, points: list[Point], vocabulary: int, out: dict) -> None:
        """transformers' generate at the points' rows, in a process of its own, within the time left."""
        kept: list[Point] = []
        for point in points:
            if self.affords(point, out, sum(map(self.budget.cost, kept))):
                kept.append(point)
        if not kept:
            return
        points = kept
        args, rows = self.args, [p.rows for p in points]
        limit = self.budget.left() - self.budget.need([p for p in self.later if p.key], started={points[0].shape})
        out["anchor"] = {"rows_asked": rows, "limit_s": round(limit, 1), "points": []}
        command = [sys.executable, str(ANCHOR), str(folder), "--rows", ",".join(map(str, rows)),
                   "--device", args.device, "--prompt-tokens", str(args.prompt_tokens),
                   "--new-tokens", str(args.new_tokens), "--vocabulary", str(vocabulary)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=max(limit, 10))
            printed, warned = done.stdout, done.stderr
            failure = done.stderr[-1500:] if done.returncode else None
        except subprocess.TimeoutExpired as expired:
            printed, warned = text(expired.stdout), text(expired.stderr)
            failure = f"timed out after {max(limit, 10):.0f} s"
        lines = [json.loads(line[len("ANCHOR "):]) for line in printed.splitlines() if line.startswith("ANCHOR ")]
        if lines:
            out["anchor"] |= lines[0] | {"points": lines[1:]}
        if failure:
            out["anchor"]["error"] = failure
        # whether the compile kept its CUDA graphs: torch says so on stderr when it does not
        out["anchor"]["compile_notes"] = [line[:300] for line in warned.splitlines()
                                          if re.search(r"cudagraph|graph break|recompil", line, re.IGNORECASE)][:10]
        compiles = [p["first_call_s"] for p in lines[1:] if "first_call_s" in p]
        if compiles and args.device == "cuda":
            self.budget.compile_s = max(compiles)
        log(points[0].shape, "anchor", out["anchor"])

    def affords(self, point: Point, out: dict, committed: float = 0.0) -> bool:
        """Take ``point`` off the points to come; whether the time left covers it (else noted skipped)."""
        self.later.remove(point)
        if self.budget.affords(point, self.later, committed):
            return True
        out["skipped"].append(asdict(point) | {"why": "budget"})
        return False

    def keep(self) -> None:
        """The detail so far into $OUT/gpu_bench-progress.json: what a time limit leaves of the run."""
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_bench-progress.json").write_text(
                json.dumps(self.detail, indent=1, default=str))


def text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def tokenizer_folder(given: str | None) -> Path:
    carried = ROOT / ".gpu" / "tok"
    if given is None and (carried / "config.json").exists():
        return carried
    return Path(given) if given and Path(given).is_dir() else materialize(resolve(given or DEFAULT_CHAT_MODEL))


def environment(args) -> dict:
    cuda = args.device == "cuda"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "hbm_tbps": args.hbm_tbps,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "settings": {k: v for k, v in os.environ.items() if k.startswith("UNIUN_") or k == "USE_HUB_KERNELS"}}


# -- the record --------------------------------------------------------------------------------------

def record_rows(record: Record, detail: dict, args) -> None:
    """BENCHMARKS.md's rows: per shape its steps against the anchor's, the roofline, the chat, the load."""
    for shape, out in detail["shapes"].items():
        label = LABELS.get(shape, shape)
        anchored = {p["rows"]: p for p in out.get("anchor", {}).get("points", []) if "step_ms" in p}
        for point in out.get("project", []):
            step_row(record, label, shape, point, anchored.get(point["rows"]))
        if "error" in out:
            record.row(f"{label}: the run", "failed: " + out["error"].strip().splitlines()[-1][:200])
        if "roofline_step_ms" not in out:
            continue
        roofline, most = out["roofline_step_ms"], max(args.rows)
        record.row(f"{label}: roofline step ({out['weight_bytes'] / 1e9:.3g} GB of weights / {args.hbm_tbps} TB/s)",
                   f"{roofline:.3g} ms ({most / roofline * 1e3:,.0f} tok/s at {rows(most)})")
        chat_row(record, label, shape, out, detail["prompt_tokens"])
        if "load_s" in out:
            record.row(f"{label}: load through `Engine` (its probe included)", f"{out['load_s']:.1f} s")
            record.row(f"{label}: graph capture at load (`describe()`)",
                       shown(out.get("capture", {})) or "not reported")
        left_out(record, label, "skipped for the time left", out["skipped"])
    for shape in dict.fromkeys(p["shape"] for p in detail["trimmed"]):
        left_out(record, LABELS.get(shape, shape), "trimmed from the plan (--budget)",
                 [p for p in detail["trimmed"] if p["shape"] == shape])
    determinism = {k: v for out in detail["shapes"].values() for k, v in out.get("determinism", {}).items()}
    record.row("determinism setting the figures were taken with",
               (shown(determinism) or "none reported by the engine: its default")
               + f"; torch deterministic algorithms {'on' if detail['env']['deterministic_algorithms'] else 'off'}")


def step_row(record: Record, label: str, shape: str, point: dict, anchored: dict | None) -> None:
    figure = f"{label}, {rows(point['rows'])}: decode step, `Batch` / static compiled `generate`"
    if "step_ms" not in point:
        record.row(figure, point.get("error", "not measured"))
        return
    ours = f"{point['step_ms']:.2f} ms ({point['tok_s']:,.0f} tok/s)"
    goal = f"≤ {RATIO_GOAL}× the anchor" if shape in GOAL_SHAPES and point["rows"] in (1, 64) else ""
    if anchored is None:
        record.row(figure, ours + " / anchor not run", goal)
        return
    ratio = point["step_ms"] / anchored["step_ms"]
    record.row(figure, f"{ours} / {anchored['step_ms']:.2f} ms ({anchored['tok_s']:,.0f} tok/s) = {ratio:.2f}×",
               goal, ratio <= RATIO_GOAL if goal else None)


def chat_row(record: Record, label: str, shape: str, out: dict, prompt_tokens: int) -> None:
    """The chat's TTFT beside the busy rows (alone in brackets), and its tokens' pace beside / alone."""
    alone = out.get("chat_alone") or {}
    beside = next((p["chat_beside"] for p in out.get("project", []) if "chat_beside" in p), None)
    if not alone.get("ttft_ms"):
        return
    if beside is None or not beside.get("ttft_ms"):
        record.row(f"{label}: chat TTFT alone ({prompt_tokens}-token prompt)", f"{alone['ttft_ms']:.1f} ms")
        return
    goal, busy = shape == "llama-1b" and beside["busy_rows"] == 63, rows(beside["busy_rows"], "busy row")
    ttft = beside["ttft_ms"]
    record.row(f"{label}: chat TTFT beside {busy} ({prompt_tokens}-token prompt)",
               f"{ttft:.1f} ms (alone {alone['ttft_ms']:.1f} ms)",
               f"≤ {CHAT_TTFT_GOAL_S * 1e3:.0f} ms" if goal else "", ttft <= CHAT_TTFT_GOAL_S * 1e3 if goal else None)
    if beside.get("token_ms") and alone.get("token_ms"):
        pace = beside["token_ms"] / alone["token_ms"]
        record.row(f"{label}: the chat's tokens beside {busy} / alone (R23)",
                   f"{beside['token_ms']:.1f} / {alone['token_ms']:.1f} ms = {pace:.2f}×",
                   f"≤ {CHAT_PACE_GOAL}×" if goal else "", pace <= CHAT_PACE_GOAL if goal else None)


def left_out(record: Record, label: str, why: str, points: list[dict]) -> None:
    """One row for the points of a shape that did not run: which kind at which rows."""
    kinds = {kind: [str(p["rows"]) for p in points if p["kind"] == kind] for kind in ("project", "anchor")}
    if points:
        record.row(f"{label}: {why}", "; ".join(f"{kind} at {', '.join(counts)} rows"
                                                 for kind, counts in kinds.items() if counts))


def rows(count: int, what: str = "row") -> str:
    return f"{count} {what}{'s' if count != 1 else ''}"


def shown(found: dict) -> str:
    return "; ".join(f"{key}: {value}" for key, value in found.items())


def results(args, models: Path) -> Path:
    """Where the record goes: benchmarks/results/ from a GPU (or BENCH_RESULTS); a CPU's dry run
    in $OUT or beside its models, never among the figures."""
    if args.device == "cuda" or "BENCH_RESULTS" in os.environ:
        return RESULTS
    return Path(os.environ.get("OUT") or models)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    tokenizer = tokenizer_folder(args.tokenizer)
    budget = Budget(args, json.loads((tokenizer / "config.json").read_text())["vocab_size"])
    points, trimmed = budget.trim(plan(args))
    if args.plan:
        print("\n".join(f"{'run ' if p in points else 'trim'} {p}" for p in points + trimmed))
        return 0
    models = Path(args.models or tempfile.mkdtemp(prefix="gpu-bench-"))
    run = Run(args, budget, points, tokenizer, models)
    run.detail.update(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), budget_s=args.budget,
                      prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, env=environment(args),
                      plan=[asdict(p) for p in points], trimmed=[asdict(p) for p in trimmed])
    log("env", run.detail["env"], f"{len(points)} points planned, {len(trimmed)} trimmed")
    record = Record("GPU", quick=args.quick, name="gpu_bench", note=os.environ.get("GPU_CHECK_NOTE", ""))
    record.runs_on(dtype="bfloat16" if args.device == "cuda" else "float32", engine="transformers")
    try:
        for shape in dict.fromkeys(p.shape for p in points):
            try:
                run.shape(shape)
            except Exception:  # noqa: BLE001 - the next shape still runs; the record says what failed
                run.detail["shapes"][shape]["error"] = traceback.format_exc()[-1500:]
                log(shape, "failed:", run.detail["shapes"][shape]["error"])
                run.later = [p for p in run.later if p.shape != shape]
    finally:
        run.detail |= {"elapsed_s": time.monotonic() - budget.started, "ray_imported": "ray" in sys.modules}
        run.keep()
        record_rows(record, run.detail, args)
        record.detail = run.detail
        record.save(results(args, models))
    if run.detail["ray_imported"]:
        print("gpu_bench: Ray was imported; the lent GPU machine has none", file=sys.stderr)
        return 3
    return 1 if any("error" in out for out in run.detail["shapes"].values()) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))   # a time limit still saves what was measured
    sys.exit(main())
