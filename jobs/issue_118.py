"""Issue #118: the user chats while Nataraj fills its deck. Before the scheduler, chat waited
30-110 s for the first token; now a chat preempts the card being written at the next token,
and the card resumes afterwards.

    python jobs/issue_118.py [--turns 3] [--deck 3] [--model ID] [--address ADDR]
    ray job submit --working-dir . -- python jobs/issue_118.py

Prints chat TTFT with the device idle next to chat TTFT while Nataraj fills (both on the
active chat model, as in the notes' table). Each busy turn is sent while a card is being
written, so it always has something to preempt.

See jobs/README.md for running it under `ray job submit`.
"""
from __future__ import annotations

import statistics

import ray

import uniun_ray
from common import job_parser, session
from uniun_ray.producers import spawn_producer


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--turns", type=int, default=3, help="chat turns per phase (default 3)")
    parser.add_argument("--deck", type=int, default=3, help="Nataraj deck size (default 3)")
    parser.add_argument("--card-tokens", type=int, default=96, help="tokens per card (default 96)")
    parser.add_argument("--chat-tokens", type=int, default=12, help="tokens per chat answer (default 12)")
    parser.add_argument("--model", help="model id for both (default: the active chat model)")
    args = parser.parse_args(argv)

    session(args)

    def chat() -> float:
        return uniun_ray.generate("chat", "Reply with one friendly word.", model_id=args.model,
                                  max_new_tokens=args.chat_tokens).ttft_s

    chat()  # load the model: its swap is not what this measures
    idle = [chat() for _ in range(args.turns)]

    deck = spawn_producer("nataraj", "issue118", deck_size=args.deck, model_id=args.model,
                          max_new_tokens=args.card_tokens)
    busy = []
    try:
        for _ in range(args.turns):
            # the device may be shared (other producers' extracts run first, T2 before T4): wait long
            if not uniun_ray.wait_generating("nataraj", timeout_s=180):
                print("Nataraj never got the device; is the model loading?")
                break
            busy.append(chat())
        # the card the chats interrupted: revoked at each chat, resumed from its tokens each time
        card = ray.get(deck.take_card.remote()) if ray.get(deck.wait_deck.remote(1, timeout_s=60)) else None
        state = ray.get(deck.state.remote())
    finally:
        ray.get(deck.stop.remote())

    def show(values: list[float | None]) -> str:
        values = [v for v in values if v is not None]  # a turn that produced no token has no TTFT
        return f"median {statistics.median(values):.2f}s, max {max(values):.2f}s (n={len(values)})" if values else "-"
    print(f"chat TTFT, device idle:        {show(idle)}")
    print(f"chat TTFT, while Nataraj fills: {show(busy)}")
    first = f"; the first card was preempted {card['revokes']} times and resumed" if card else ""
    print(f"nataraj: {state['done']} cards written, {state['failed']} failed{first}")


if __name__ == "__main__":
    main()
