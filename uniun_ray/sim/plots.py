"""Pictures drawn from event logs (a simulation's or a real run's JSONL, same schema):
the device timeline, chat TTFT CDFs, and cumulative service per flow. PNG via Agg, so
it works headless.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from ..events.trace import Run, Trace  # noqa: E402

KIND_COLORS = {"chat": "#d62728", "nataraj": "#9467bd", "gana": "#1f77b4", "extract": "#2ca02c"}
SWAP_COLOR = "#7f7f7f"
FOREGROUND_ROW = "foreground"
LINE_STYLES = ["-", "--", ":", "-."]  # identical curves (two policies that agree) stay visible


def _row(kind: str, producer: str) -> str:
    """Chat sessions share one row; every other flow gets its own."""
    return "chat" if kind == "chat" else producer


def _rows(trace: Trace) -> list[tuple[str, str]]:
    """(row name, kind) in kind order, then by name."""
    order = list(KIND_COLORS)
    rows = {(order.index(r.kind), _row(r.kind, r.producer), r.kind) for r in trace.jobs.values()}
    return [(name, kind) for _, name, kind in sorted(rows)]


def timeline(trace: Trace, path: str | Path, title: str = "", span: tuple[float, float] | None = None) -> None:
    """A Gantt chart of the device: who held it when, coloured by kind; swaps hatched
    grey at the start of a run; revokes as black triangles; the foreground on top."""
    rows = [name for name, _ in _rows(trace)]
    y = {name: i for i, name in enumerate([FOREGROUND_ROW] + rows)}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.4 * len(y)))
    bars: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    swaps: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in trace.runs:
        row = _row(run.kind, run.producer)
        bars[(row, run.kind)].append((run.start + run.swap_s, run.held - run.swap_s))
        if run.swap_s > 0:
            swaps[row].append((run.start, run.swap_s))
    for (row, kind), spans in bars.items():
        ax.broken_barh(spans, (y[row] - 0.4, 0.8), facecolors=KIND_COLORS[kind], linewidth=0)
    for row, spans in swaps.items():
        ax.broken_barh(spans, (y[row] - 0.4, 0.8), facecolors="white", edgecolors=SWAP_COLOR, hatch="////",
                       linewidth=0.5)
    revoked = [(t, y[_row(trace.jobs[job].kind, trace.jobs[job].producer)]) for t, job in trace.revokes]
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor=SWAP_COLOR, hatch="////"))
    labels = [*KIND_COLORS, "swap"]
    if revoked:
        handles.append(ax.scatter(*zip(*revoked), marker="v", color="black", s=18, zorder=3))
        labels.append("revoke")
    for a, b, kind in _foreground_spans(trace):
        ax.broken_barh([(a, b - a)], (y[FOREGROUND_ROW] - 0.4, 0.8), facecolors=KIND_COLORS[kind], alpha=0.35)
    ax.set_yticks(list(y.values()), list(y))
    ax.invert_yaxis()
    ax.set_xlim(*(span or (trace.start, trace.end)))
    ax.set_xlabel("time (s)")
    ax.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small",
              ncol=len(labels), frameon=False)
    ax.set_title(title, loc="left")
    _save(fig, path)


def _foreground_spans(trace: Trace):
    changes = [(t, fg.kind.value if fg.kind else None) for t, fg in trace.foreground]
    for (a, kind), (b, _) in zip(changes, changes[1:] + [(trace.end, None)]):
        if kind is not None and b > a:
            yield a, b, kind


def ttft_cdf(traces: dict[str, Trace], path: str | Path, title: str = "") -> None:
    """Chat time to first token, one CDF per policy, log time axis."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, trace), style in zip(traces.items(), LINE_STYLES * len(traces)):
        ttft = sorted(r.first_token - r.submit for r in trace.jobs.values()
                      if r.kind == "chat" and r.first_token is not None)
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=name,
                    linestyle=style, linewidth=1.8)
    ax.set_xscale("log")
    ax.set_xlabel("chat TTFT (s)")
    ax.set_ylabel("fraction of chat turns")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title)
    _save(fig, path)


def service(trace: Trace, path: str | Path, title: str = "") -> None:
    """Cumulative device time held by each flow (R7's charge), over time."""
    fig, ax = plt.subplots(figsize=(9, 5))
    per_row: dict[str, list[Run]] = defaultdict(list)
    for run in trace.runs:
        per_row[_row(run.kind, run.producer)].append(run)
    for row, kind in _rows(trace):
        xs, ys, total = [trace.start], [0.0], 0.0
        for run in per_row.get(row, []):
            xs += [run.start, run.end]
            total += run.held
            ys += [ys[-1], total]
        ax.plot(xs, ys, label=row, linestyle="-" if kind in ("nataraj", "gana") else ":")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("cumulative service (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    ax.set_title(title)
    _save(fig, path)


def _save(fig, path: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
