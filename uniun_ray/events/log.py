"""The event log as a file: JSONL, one event of `schema` a line, and the one reader of it.

The runtime's scheduler appends every decision (`EventLog`, size-bounded); the simulator and
the replay write a whole run at once (`write`); metrics, pictures, `explain`, the status view
and the CLI read either back (`read`, or `tail` for the newest events), so none of them needs
the runtime to read a file. Rotation is the standard library's RotatingFileHandler: when the
file passes `max_bytes` it is renamed `.1` (older ones shift up to `backups`) and a new file
starts, so the log never grows without bound. Pure Python (no Ray, no torch).
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import os
from pathlib import Path
from typing import Iterable

from ..settings import state_dir
from .schema import Event

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_BACKUPS = 3


def default_path() -> Path:
    return state_dir() / "events.jsonl"


class EventLog:
    def __init__(self, path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=max_bytes,
                                                             backupCount=backups, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def write(self, event: Event) -> None:
        record = logging.LogRecord("uniun.events", logging.INFO, "", 0, _line(event), None, None)
        self._handler.emit(record)

    def close(self) -> None:
        self._handler.close()


def write(events: Iterable[Event], path: str | Path) -> None:
    """A whole log at once (a simulation's, a replay's), replacing the file."""
    with open(path, "w", encoding="utf-8") as f:
        for event in events:
            f.write(_line(event) + "\n")


def read(path: str | Path) -> list[Event]:
    """Every event of a log and its rotated backups, oldest first."""
    path = Path(path)
    files = sorted((p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()),
                   key=lambda p: -int(p.suffix[1:]))
    events = []
    for file in [*files, path]:
        if file.exists():
            with open(file, encoding="utf-8") as f:
                events.extend(_events(f))
    return events


def tail(path: str | Path, max_bytes: int = 256 * 1024) -> list[Event]:
    """The newest events, cheaply (a live view polls this every second; `read` would parse
    up to the whole rotated history): about the last `max_bytes` of the log, reaching into
    the newest backup when the current file was just rotated. Oldest first."""
    path = Path(path)
    chunks = []
    for file in (path, path.with_name(path.name + ".1")):
        try:
            with open(file, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - max_bytes))
                data = f.read()
        except FileNotFoundError:
            continue
        lines = data.split(b"\n")[:-1]  # after the last newline: nothing, or a line being written
        chunks.insert(0, lines[1:] if size > max_bytes else lines)  # the first line may be cut
        max_bytes -= len(data)
        if max_bytes <= 0:
            break
    return _events(line for lines in chunks for line in lines)


def _line(event: Event) -> str:
    return json.dumps(event, separators=(",", ":"))


def _events(lines: Iterable[str | bytes]) -> list[Event]:
    return [json.loads(line) for line in lines if line.strip()]
