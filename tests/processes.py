"""Whether processes a test started are still there: an ended one may stay a zombie until its
new parent reaps it (an init that reaps nothing, in some containers), which counts as gone."""
from __future__ import annotations

import time


def running(pid: int) -> bool:
    """Neither gone nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def left(pids: list[int], within_s: float = 30.0) -> list[int]:
    """Those of `pids` still running after `within_s` at most."""
    deadline = time.monotonic() + within_s
    while (still := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return still
