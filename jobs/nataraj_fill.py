"""Nataraj: a NatarajProducer keeps its deck of cards filled; we take a few and watch it refill.

    python jobs/nataraj_fill.py [--deck 4] [--take 2] [--open-page] [--model ID] [--address ADDR]
    ray job submit --working-dir . -- python jobs/nataraj_fill.py --model tiny

See jobs/README.md for running it under `ray job submit`.
"""
from __future__ import annotations

import time

import ray

from common import job_parser, session
from uniun_ray.producers import spawn_producer


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--deck", type=int, default=4, help="cards the deck holds (default 4)")
    parser.add_argument("--take", type=int, default=2, help="cards to take, then wait for the refill (default 2)")
    parser.add_argument("--open-page", action="store_true", help="the deck page is open: nataraj is foreground (T1)")
    parser.add_argument("--model", help="model id (default: the active chat model)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if not 1 <= args.take <= args.deck:
        parser.error(f"--take must be between 1 and --deck ({args.deck}), got {args.take}")

    session(args)
    started = time.perf_counter()
    deck = spawn_producer("nataraj", "fill", deck_size=args.deck, model_id=args.model,
                          max_new_tokens=args.max_new_tokens)
    try:
        if args.open_page:
            ray.get(deck.open_page.remote())
        filled = ray.get(deck.wait_deck.remote(timeout_s=args.timeout))
        print(f"deck {filled}/{args.deck} after {time.perf_counter() - started:.1f}s")
        if filled < args.take:
            raise SystemExit(f"timed out: the deck holds {filled} card(s) after {args.timeout:.0f}s, "
                             f"fewer than the {args.take} to take (a busy device? raise --timeout)")
        for _ in range(args.take):
            card = ray.get(deck.take_card.remote())
            print(f"  card [{card['topic']}] ({card['total_s']:.1f}s, {card['revokes']} revokes): "
                  f"{' '.join(card['text'].split())[:100]}")
        refill = time.perf_counter()
        filled = ray.get(deck.wait_deck.remote(timeout_s=args.timeout))
        print(f"refilled to {filled}/{args.deck} in {time.perf_counter() - refill:.1f}s")
        print(f"nataraj: {ray.get(deck.state.remote())}")
    finally:
        ray.get(deck.stop.remote())


if __name__ == "__main__":
    main()
