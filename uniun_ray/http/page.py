"""The live page: `GET /`, a view of the device, the queues and every decision,
served by the same app as the API (same host, port and key).

The page is static: `static/index.html`, `page.js` and `page.css`, plain HTML, SVG and
JavaScript with no dependency and no build step, served by the app itself (nothing from a
CDN). It polls two routes of the API once a second:

    GET /v1/status                 the scheduler's snapshot (already part of SPEC §4)
    GET /v1/events?since=T         the event log's events after T (at most the last 5 min)
    GET /v1/explain/{job_id}       one job's story, as `uniun-ray explain` tells it

The page and its assets hold no data, so they are served without the key; the data routes
need it like every other route. With UNIUN_API_KEY set the page asks for the key once (or
takes it from the URL fragment, `/#key=...`, which never reaches the server) and keeps it in
the tab's sessionStorage.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from .errors import APIError, from_client
from .openapi import ERRORS

STATIC = Path(__file__).parent / "static"
#: The timeline's span, and the most the events route returns.
WINDOW_S = 300.0
MAX_EVENTS = 5000
EXPLAIN_SCAN_BYTES = 8 * 1024 * 1024


_LOG_PATH: list[Path] = []


async def event_log() -> Path | None:
    """The scheduler's event log (its `status()` names it; read on this node), found once."""
    if not _LOG_PATH:
        import uniun_ray

        try:
            _LOG_PATH.append(Path((await uniun_ray.astatus())["event_log"]))
        except Exception:
            return None
    return _LOG_PATH[0]


def lines_backwards(path: Path, limit: int, chunk: int = 64 * 1024):
    """The complete lines of a file, newest first, reading at most `limit` bytes from its end."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        position = f.seek(0, os.SEEK_END)
        tail = b""
        while position > 0 and limit > 0:
            step = min(chunk, position, limit)
            position -= step
            limit -= step
            f.seek(position)
            lines = (f.read(step) + tail).split(b"\n")
            tail = lines[0]   # may be cut: completed by the next chunk back
            yield from reversed(lines[1:])
        if position == 0:
            yield tail


def events_since(path: Path, since: float, limit: int = MAX_EVENTS) -> list[dict]:
    """Events with t > since, oldest first, read back from the log's end (and its newest
    backup) until an older one: the cost follows the new events, not the log's size."""
    out: list[dict] = []
    for file in (path, path.with_name(path.name + ".1")):
        for line in lines_backwards(file, 64 * 1024 * 1024):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("t", 0) <= since or len(out) >= limit:
                out.reverse()
                return out
            out.append(event)
    out.reverse()
    return out


def story(path: Path, job_id: str) -> list[str]:
    from ..observe.explain import explain

    events = []
    for line in lines_backwards(path, EXPLAIN_SCAN_BYTES):
        if line.strip():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    events.reverse()
    return explain(events, job_id)


def install(app: FastAPI, require_scheduler) -> None:
    """Add the page and its data routes to `app` (the API's auth applies to the routes;
    the page and assets are public: they hold no data)."""
    public = APIRouter()

    @public.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.router.routes.extend(public.routes)   # outside the app-wide auth dependency
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/v1/events", responses=ERRORS)
    async def events(since: float = Query(default=0.0, ge=0)):
        require_scheduler()
        path = await event_log()
        if path is None:
            raise from_client(RuntimeError("the scheduler did not say where its event log is"))
        now = time.time()
        found = await asyncio.to_thread(events_since, path, max(since, now - WINDOW_S))
        return {"now": now, "window_s": WINDOW_S, "events": found}

    @app.get("/v1/explain/{job_id}", responses=ERRORS)
    async def explain(job_id: str):
        path = await event_log()
        if path is None:
            raise APIError(404, "no event log on this node", code="not_found")
        try:
            lines = await asyncio.to_thread(story, path, job_id)
        except KeyError as error:
            raise APIError(404, error.args[0], code="job_not_found", param="job_id") from None
        return {"job_id": job_id, "lines": lines}
