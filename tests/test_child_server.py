"""An engine's model server ends with every process it started (`engines.server`), whichever
way its owner lets go: `stop` (an unload), the owner's exit, the owner killed (a ModelActor
killed by Ray, `uniun-ray down`). Ray-free: the server is a stand-in that starts two sleepers
as vLLM's server starts its engine core, one of them in a session of its own."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from processes import left
from uniun_ray.engines.server import ChildServer, free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")

#: A server that answers /health once its two children run, having written its pid and theirs.
STAND_IN = textwrap.dedent("""
    import http.server, os, sys, time

    def sleeper(own_session):
        pid = os.fork()
        if pid == 0:
            if own_session:
                os.setsid()   # out of the server's process group
            time.sleep(600)
            os._exit(0)
        return pid

    port, pids = int(sys.argv[1]), sys.argv[2]
    children = [sleeper(False), sleeper(True)]
    with open(pids + ".tmp", "w") as f:
        f.write(" ".join(map(str, [os.getpid(), *children])))
    os.replace(pids + ".tmp", pids)
    http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
""")

#: The server's owner, as a ModelActor is: it starts the server, says so, then waits or exits.
OWNER = textwrap.dedent("""
    import sys, time
    from uniun_ray.engines.server import ChildServer
    command, port, then = sys.argv[1:-2], int(sys.argv[-2]), sys.argv[-1]
    server = ChildServer(command, port, health="/")   # held: a server no one holds is ended
    server.start(60)
    print("up", flush=True)
    if then == "wait":
        time.sleep(600)
""")


def stand_in(tmp_path: Path) -> tuple[list[str], int, Path]:
    script, pids, port = tmp_path / "server.py", tmp_path / "pids", free_port()
    script.write_text(STAND_IN)
    return [sys.executable, str(script), str(port), str(pids)], port, pids


def processes(pids: Path) -> list[int]:
    """The stand-in's pid and its two children's."""
    return [int(pid) for pid in pids.read_text().split()]


def test_stop_ends_the_server_and_every_process_it_started(tmp_path):
    command, port, pids = stand_in(tmp_path)
    server = ChildServer(command, port, health="/")
    server.start(60)
    try:
        started = processes(pids)
        assert left(started, within_s=0) == started      # all three run
    finally:
        server.stop()
    assert not left(started, within_s=0) and not server.alive()


@pytest.mark.parametrize("owner_goes", ["killed", "exits"])
def test_the_server_and_every_process_it_started_end_with_their_owner(tmp_path, owner_goes):
    """Killed: nothing of the owner runs (SIGKILL, as Ray kills an actor); the supervisor
    hears of it from Linux. Exits: the owner's finalizers run, as at an actor's normal exit."""
    command, port, pids = stand_in(tmp_path)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, *command, str(port),
                              "wait" if owner_goes == "killed" else "exit"], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        started = processes(pids)
        if owner_goes == "killed":
            owner.kill()
        owner.wait(60)
        assert not left(started)
    finally:
        owner.kill()
        owner.stdout.close()
