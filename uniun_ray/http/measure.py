"""Timing requests to the endpoint as an HTTP client sees them (the demo and the benchmark)."""
from __future__ import annotations

import json
import time

import requests

from ..engines.server import free_port  # noqa: F401  (the demo and the benchmarks take it from here)


def stream_ttft(url: str, body: dict, path: str = "/v1/chat/completions", api_key: str | None = None,
                timeout: float = 600) -> tuple[float, dict]:
    """POST a streaming request; return (seconds from sending it to the first piece of text,
    the last chunk, which carries uniun's facts). Reads the stream to its end."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started, ttft, last = time.perf_counter(), None, {}
    with requests.post(url + path, json=body | {"stream": True}, headers=headers, stream=True,
                       timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            choice = (chunk.get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if ttft is None and text:
                ttft = time.perf_counter() - started
            last = chunk
    return (time.perf_counter() - started if ttft is None else ttft), last
