"""What a conversation's long history costs one forward pass (issue 28: the 5th turn against a
one-message chat), in the bare engine, in CPU time of one thread:

    .venv/bin/python benchmarks/turn_cost.py              # section "KV cache" of BENCHMARKS.md
    .venv/bin/python benchmarks/turn_cost.py --quick      # three rounds instead of fifteen

SmolLM2 as the chat model. A one-message chat reads ~16 new tokens over the ~28 of the chat
template's cached start; the 5th one-line turn reads ~18 over ~1,177 cached. Each is timed as
the engine runs it (its attention, `models/runner/attention.py`; a history grown in place,
`models/kv/prefix.py`) and as transformers alone would (SDPA copying the grouped K/V heads, a
cache that concatenates), interleaved in rounds; the figure is the least of the rounds (what the
pass costs when nothing else takes the core; a median under other work is noise). One thread,
so that the CPU time is the pass's own.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from record import Record

from uniun_ray.models import DEFAULT_CHAT_MODEL, Engine
from uniun_ray.settings import EngineSettings
from uniun_ray.models.runner.attention import NAME
from uniun_ray.models.kv.prefix import crop_layers, fork

#: (new tokens, cached tokens) of the passes compared.
PASSES = {"one-message chat: 16 new tokens over 28 cached": (16, 28),
          "5th one-line turn: 18 new tokens over 1,177 cached": (18, 1177),
          "a decode step over 28 cached": (1, 28),
          "a decode step over 1,177 cached": (1, 1177)}


def plain_fork(cache):
    """A fork as transformers' DynamicCache would extend it: by concatenation."""
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    return twin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", help="auto (the engine's choice on this host), bfloat16 or float32")
    ap.add_argument("--quick", action="store_true", help="three rounds")
    args = ap.parse_args()
    engine = Engine(settings=EngineSettings(dtype=args.dtype, threads=1, kv_cache_mb=0))
    engine.load(DEFAULT_CHAT_MODEL)
    loaded, device = engine._loaded, engine.device
    ids = torch.randint(100, len(loaded.vocabulary.tokenizer) - 1, (1300,), generator=torch.Generator().manual_seed(0)).tolist()
    history = {n: loaded.runner.prefill(ids[:n], None, device)[1] for _, n in PASSES.values()}

    def grown(n: int):
        """The history as a turn leaves it in the engine: grown in place, writable at its end."""
        cache = fork(history[n])
        crop_layers(cache, n - 1)
        return fork(loaded.runner.prefill(ids[n - 1:n], cache, device)[1])

    ways = {"the engine": (NAME, grown), "transformers alone": ("sdpa", lambda n: plain_fork(history[n]))}
    best: dict[tuple[str, str], float] = {}
    for _ in range(3 if args.quick else 15):
        for way, (attention, cache_of) in ways.items():
            loaded.model.set_attn_implementation(attention)
            for name, (new, cached) in PASSES.items():
                cache = cache_of(cached)
                started = time.thread_time()
                loaded.runner.prefill(ids[cached:cached + new], cache, device)
                spent = time.thread_time() - started
                best[way, name] = min(best.get((way, name), spent), spent)
    record = Record("kv-cache", quick=args.quick)
    record.runs_on(threads=1, dtype=loaded.dtype, engine="transformers")
    for name in PASSES:
        record.row(f"one forward pass of {DEFAULT_CHAT_MODEL}, {name}: the engine / transformers alone (CPU, least of the rounds)",
                   f"{best['the engine', name] * 1e3:.0f} / {best['transformers alone', name] * 1e3:.0f} ms")
    for way in ways:
        ratio = best[way, "5th one-line turn: 18 new tokens over 1,177 cached"] / \
            best[way, "one-message chat: 16 new tokens over 28 cached"]
        record.row(f"the 5th turn's pass / a one-message chat's, {way}", f"{ratio:.2f}×")
    record.save()


if __name__ == "__main__":
    main()
