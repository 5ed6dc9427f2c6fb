"""What one greedy answer costs (issue 35): SmolLM2's decode tokens/s through ``Batch`` with the
engine's batch-invariant CPU decode (``UNIUN_DETERMINISTIC=1``: each padded row attends its own
keys alone; a packed linear runs one row as two) against the same steps without it.

    .venv/bin/python benchmarks/invariance_bench.py                # 5 rounds of 32 steps per size
    .venv/bin/python benchmarks/invariance_bench.py --quick        # 1 round of 8 steps
    .venv/bin/python benchmarks/invariance_bench.py --prefill      # what the setting costs a prefill

``--prefill`` times a chat's time to first token over a 1,000-token prompt (nothing cached:
with the setting each pass runs in whole attention blocks, the last token alone) and a
conversation's next turn (with the setting the cache may not reuse the decoded reply: it is read
again), on an engine with ``UNIUN_DETERMINISTIC`` against one without, in alternate rounds.

Rounds alternate the two ways at every batch size, so a host whose speed drifts stretches both
alike; each figure is the median over the rounds. "Without" puts back what ran before issue 35:
one SDPA call over the padded rows with their mask, and oneDNN's one-row kernel (the default).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_bench import MODEL, batch_tokens_per_s  # noqa: E402
from record import Record  # noqa: E402

from uniun_ray.models import Engine, GenerateRequest, generate  # noqa: E402
from uniun_ray.settings import EngineSettings  # noqa: E402
from uniun_ray.models.runner import attention  # noqa: E402
from uniun_ray.models.load import packing  # noqa: E402


@contextmanager
def by_default(model):
    """The decode as without the setting: padded rows in one masked SDPA call, one row on its own kernel."""
    linears = [module for module in model.modules() if isinstance(module, packing.PackedLinear)]
    model.set_attn_implementation(attention.NAME)
    for linear in linears:
        linear.one_row_as_two = False
    try:
        yield
    finally:
        model.set_attn_implementation(attention.ROW_INVARIANT)
        for linear in linears:
            linear.one_row_as_two = True


def ttfts(engine: Engine) -> tuple[float, float]:
    """A chat's TTFT over a 1,000-token prompt, nothing cached; a next turn's after a 100-token reply."""
    tokenizer = engine.resident.vocabulary.tokenizer
    words = " ".join(f"Note {i}: the sky, the sea and a cat named {i * 7}." for i in range(120))
    long = tokenizer.decode(tokenizer(words)["input_ids"][:1000])
    engine.resident.prefix.clear()
    first = _run(engine, GenerateRequest(prompt=long, max_new_tokens=1))
    turn = [{"role": "user", "content": words[:1200]}]
    reply = _run(engine, GenerateRequest(messages=turn, max_new_tokens=100, stop=()))
    turn += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Now in one line."}]
    return first.ttft_s, _run(engine, GenerateRequest(messages=turn, max_new_tokens=1)).ttft_s


def _run(engine: Engine, request: GenerateRequest):
    import threading

    generation = generate(engine, request, threading.Event(), revocable=False)
    for _ in generation:
        pass
    return generation.result


def prefill_main(args) -> None:
    exact, default = (Engine(settings=EngineSettings(dtype=args.dtype, deterministic=flag)) for flag in (True, False))
    for engine in (exact, default):
        engine.load(MODEL)
        ttfts(engine)                    # warm-up, not recorded
    record = Record("slots", quick=args.quick, name="invariance_bench-prefill")
    record.runs_on(threads=default.describe()["threads"], dtype=default.describe()["dtype"], engine="uniun Engine")
    runs = {exact: [], default: []}
    for _ in range(1 if args.quick else 5):
        for engine in runs:
            runs[engine].append(ttfts(engine))
    for index, what in enumerate(("chat TTFT, 1,000-token prompt, nothing cached",
                                  "next turn TTFT, after a 100-token reply")):
        now, then = (statistics.median(run[index] for run in runs[engine]) for engine in (exact, default))
        record.row(f"{MODEL} {what}: UNIUN_DETERMINISTIC=1 against the default (cost)",
                   f"{now * 1e3:.0f} vs {then * 1e3:.0f} ms ({now / then - 1:+.0%})", goal="cost ≤ 10%",
                   met=now <= 1.1 * then)
    record.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 8 steps per batch size")
    ap.add_argument("--prefill", action="store_true", help="what the setting costs a prefill instead")
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if args.prefill:
        return prefill_main(args)
    rounds, steps = (1, 8) if args.quick else (5, 32)
    engine = Engine(settings=EngineSettings(dtype=args.dtype, kv_cache_mb=0, deterministic=True))
    engine.load(MODEL)
    described = engine.describe()
    record = Record("slots", quick=args.quick)
    record.runs_on(threads=described["threads"], dtype=described["dtype"], engine="uniun Batch")
    batch_tokens_per_s(engine, 2, 4)     # warm-up, not recorded
    sizes = list(map(int, args.sizes.split(",")))
    rates = {(rows, way): [] for rows in sizes for way in ("invariant", "before")}
    for _ in range(rounds):
        for rows in sizes:
            rates[rows, "invariant"].append(batch_tokens_per_s(engine, rows, steps)[0])
            with by_default(engine.resident.model):
                rates[rows, "before"].append(batch_tokens_per_s(engine, rows, steps)[0])
    for rows in sizes:
        kept, before = statistics.median(rates[rows, "invariant"]), statistics.median(rates[rows, "before"])
        record.row(f"{MODEL} decode, rows={rows}: batch-invariant tokens/s against without (cost)",
                   f"{kept:.1f} vs {before:.1f} tok/s ({1 - kept / before:+.0%})", goal="cost ≤ 10%",
                   met=kept >= 0.9 * before)
    record.save()


if __name__ == "__main__":
    main()
