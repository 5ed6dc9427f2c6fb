"""The catalogue of named workloads, each generated from a seed (same seed, same JSON).

``generate(name, seed)`` returns a `Workload`; ``WORKLOADS`` lists the names:

* ``issue118``: Nataraj keeps a deck of 8 cards filling (the NatarajDeck page in front)
  while the user opens Shiv chat three times for a short conversation (the bug report).
* ``backfill``: a 500-note extract backfill, one note per second, beside Nataraj and a
  Gana agent loop (notes §5, the T2 budget).
* ``ganas``: two identical Gana agent loops (the fairness check), a third on another
  model from t=600 s, and two cron Ganas whose ticks come due (EDF, affinity).
* ``foreground``: the user moves between the Nataraj deck, a Gana form, opened notes,
  Shiv chat and the home screen while Nataraj, a Gana and a relay trickle of extracts run.
* ``mixed_day``: 24 h on two models: Nataraj always refilling, Gana sessions and crons,
  relay extracts plus a night backfill, and a dozen user sessions in waking hours.

``POOL_WORKLOADS`` saturate a pool of devices (`uniun-ray bench --devices 1,2,4`):
``pool``: three Nataraj producers on the chat model and three Gana loops on the other,
each keeping two jobs queued for 30 min, while five chat conversations come and go.
``pool_chats`` (for a chat p99 over 100+ chats): the same producers for 2 h while 34
conversations come and go (~110 chat turns), one every ~4 min.

``SLOT_WORKLOADS`` are for devices with slots (`uniun-ray bench --slots 1,4,8,16`, beside
``issue118``): ``backfill_bulk``: a backfill of 500 notes submitted at once beside Nataraj and a
Gana loop, to see how fast it drains; ``saturate``: four Nataraj producers keeping 8 cards
queued each and four Gana loops keeping 2 rounds each, all on the chat model for 30 min, more
than 16 slots can hold, while five chat conversations come and go.

``SHORT_WORKLOADS`` are minutes long, to be played on the real runtime (`replay`):
``issue118_short`` (issue118 in 2.5 min) and ``swaps_short`` (a Gana on the other model).

Token counts (medians, clipped log-normal draws; the app's prompts as the notes describe
them): a chat turn sends a ~150-token system prompt, ~300 tokens of RAG context and the
user's message, plus the conversation so far, and gets ~120 tokens back; a Nataraj card
is ~350 prompt tokens (instructions and a seed topic) for a ~180-token card; a Gana agent
round carries its tool output, ~1200 prompt tokens, for ~250 output tokens; an extract is
a note (~500 tokens) plus ~200 tokens of instructions, for ~150 tokens of JSON triples.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from .device import GEMMA3, SMOLLM2
from ..policy import Job
from .workload import Arrival, Flow, FlowStep, ForegroundChange, SimJob, Workload

CHAT_MODEL = SMOLLM2  # the active chat model: chat, Nataraj and extract use it (notes §6)


@dataclass(frozen=True)
class Size:
    """A clipped log-normal token count: median, range, and spread (sigma of the log)."""

    median: int
    lo: int
    hi: int
    sigma: float = 0.5

    def draw(self, rng: random.Random) -> int:
        return max(self.lo, min(self.hi, round(self.median * math.exp(rng.gauss(0.0, self.sigma)))))


CHAT_CONTEXT = Size(450, 250, 900)      # system prompt + RAG context
CHAT_MESSAGE = Size(40, 5, 200)
CHAT_REPLY = Size(120, 30, 350)
CARD_PROMPT = Size(350, 200, 600)
CARD = Size(180, 80, 320)
GANA_PROMPT = Size(1200, 400, 3000)
GANA_OUT = Size(250, 60, 600)
NOTE = Size(500, 80, 2000, 0.8)
EXTRACT_INSTRUCTIONS = 200
TRIPLES = Size(150, 40, 400)


# -- building blocks ----------------------------------------------------------------------
def _steps(rng: random.Random, n: int, prompt: Size, out: Size, think: tuple[float, float] = (0.0, 0.0),
           deadline_in_s: float | None = None) -> tuple[FlowStep, ...]:
    return tuple(FlowStep(prompt.draw(rng), out.draw(rng), rng.uniform(*think), deadline_in_s) for _ in range(n))


#: Distinct job sizes a backlogged producer cycles through.
BACKLOG_STEPS = 256


def _backlog(rng: random.Random, producer: str, kind: str, model: str, start: float, stop: float,
             depth: int, prompt: Size, out: Size, think: tuple[float, float] = (0.0, 0.0)) -> Flow:
    """A producer that keeps `depth` jobs queued from `start` to `stop`."""
    return Flow(producer, kind, model, start, _steps(rng, BACKLOG_STEPS, prompt, out, think), depth, stop,
                cycle=True)


def _chat(rng: random.Random, producer: str, start: float, turns: int) -> Flow:
    """A conversation: each turn resends the history, so prompts grow turn by turn; the
    next message comes 8-40 s (reading and typing) after the reply."""
    context, steps = CHAT_CONTEXT.draw(rng), []
    for i in range(turns):
        context += CHAT_MESSAGE.draw(rng)
        reply = CHAT_REPLY.draw(rng)
        steps.append(FlowStep(context, reply, 0.0 if i == 0 else rng.uniform(8.0, 40.0)))
        context += reply
    return Flow(producer, "chat", CHAT_MODEL, start, tuple(steps), conversation=True)


def _note(rng: random.Random, t: float, job_id: str, producer: str, hint: bool = False,
          subject: str | None = None) -> Arrival:
    return Arrival(t, SimJob(Job(job_id, "extract", CHAT_MODEL, producer, None, hint, subject),
                             NOTE.draw(rng) + EXTRACT_INSTRUCTIONS, TRIPLES.draw(rng)))


def _cron(rng: random.Random, producer: str, model: str, period: float, start: float, end: float,
          lead: float = 60.0) -> list[Arrival]:
    """A cron Gana: each tick is submitted `lead` seconds before its fire time, which is
    its deadline (R5: it must preempt T4 work when it falls due)."""
    fires = [start + k * period for k in range(1, int((end - start) / period) + 1)]
    return [Arrival(fire - lead, SimJob(Job(f"{producer}@{int(fire)}", "gana", model, producer, fire),
                                        GANA_PROMPT.draw(rng), GANA_OUT.draw(rng)))
            for fire in fires]


def _poisson(rng: random.Random, rate_s: float, start: float, end: float) -> list[float]:
    times, t = [], start
    while True:
        t += rng.expovariate(rate_s)
        if t >= end:
            return times
        times.append(t)


# -- the workloads ------------------------------------------------------------------------
def _deck_and_chats(rng: random.Random, end: float, depth: int, starts: tuple[float, ...], jitter: float,
                    turns: tuple[int, int], chat_page_s: float) -> tuple[list[Flow], list[ForegroundChange]]:
    """Nataraj keeps `depth` cards queued (its deck page in front) while the user opens
    Shiv chat at each start (plus up to `jitter` s) for `turns` turns, then goes back."""
    flows = [_backlog(rng, "nataraj", "nataraj", CHAT_MODEL, 0.0, end, depth, CARD_PROMPT, CARD)]
    foreground = [ForegroundChange(0.0, "nataraj")]
    for i, start in enumerate(starts):
        start += rng.uniform(0.0, jitter)
        flows.append(_chat(rng, f"chat:{i}", start, rng.randint(*turns)))
        foreground += [ForegroundChange(start - 2.0, "chat"), ForegroundChange(start + chat_page_s, "nataraj")]
    return flows, foreground


def issue118(seed: int) -> Workload:
    flows, foreground = _deck_and_chats(random.Random(seed), 900.0, 8, (120.0, 400.0, 650.0), 30.0, (3, 5), 180.0)
    return Workload("issue118", seed, "Nataraj fills a deck of 8 cards; Shiv chat opens three times",
                    flows=tuple(flows), foreground=tuple(foreground))


def _backfill(seed: int, name: str, description: str, submit_at: Callable[[int], float], end: float) -> Workload:
    """500 notes to extract, the i-th submitted at `submit_at(i)`, beside Nataraj keeping 4 cards
    queued and a Gana agent loop until `end`."""
    rng = random.Random(seed)
    notes = [_note(rng, submit_at(i), f"extract:backfill#{i}", "extract:backfill") for i in range(500)]
    flows = (
        _backlog(rng, "nataraj", "nataraj", CHAT_MODEL, 0.0, end, 4, CARD_PROMPT, CARD),
        _backlog(rng, "gana:g1", "gana", CHAT_MODEL, 0.0, end, 1, GANA_PROMPT, GANA_OUT, (1.0, 3.0)),
    )
    return Workload(name, seed, description, arrivals=tuple(notes), flows=flows)


def backfill(seed: int) -> Workload:
    return _backfill(seed, "backfill", "500-note extract backfill at 1 note/s beside Nataraj and a Gana",
                     lambda i: 10.0 + i, 3600.0)


def ganas(seed: int) -> Workload:
    rng = random.Random(seed)
    end = 1800.0
    equal = _steps(rng, BACKLOG_STEPS, GANA_PROMPT, GANA_OUT)
    flows = (
        Flow("gana:a", "gana", CHAT_MODEL, 0.0, equal, 1, end, cycle=True),
        Flow("gana:b", "gana", CHAT_MODEL, 0.0, equal, 1, end, cycle=True),
        _backlog(rng, "gana:c", "gana", GEMMA3, 600.0, end, 1, GANA_PROMPT, GANA_OUT),
    )
    crons = (_cron(rng, "gana:cron1", CHAT_MODEL, 300.0, 0.0, end)
             + _cron(rng, "gana:cron2", GEMMA3, 420.0, 0.0, end))
    return Workload("ganas", seed, "two equal Gana loops, a third on another model from 600 s, two crons",
                    arrivals=tuple(sorted(crons, key=lambda a: a.t)), flows=flows,
                    equal_flows=(("gana:a", "gana:b"),))


def _page_visit(rng: random.Random, t: float, page: str, n: int) -> tuple[list[ForegroundChange], list, list]:
    """What opening `page` at `t` does: the foreground change and the work it brings."""
    if page == "chat":
        return [ForegroundChange(t, "chat")], [], [_chat(rng, f"chat:{n}", t + 3.0, rng.randint(2, 5))]
    if page == "note":
        subject = f"note:open{n}"
        return ([ForegroundChange(t, "extract", subject)],
                [_note(rng, t, f"extract:open#{n}", "extract:open", True, subject)], [])
    if page == "home":
        return [ForegroundChange(t, None)], [], []
    return [ForegroundChange(t, page)], [], []  # "nataraj" deck, "gana" form


def _pages(rng: random.Random, start: float, end: float, dwell: tuple[float, float],
           pages: tuple[str, ...], first: int = 0) -> tuple[list, list, list]:
    foreground, arrivals, flows = [], [], []
    t, n = start, first
    while t < end:
        fg, arr, fl = _page_visit(rng, t, rng.choice(pages), n)
        foreground += fg
        arrivals += arr
        flows += fl
        t += rng.uniform(*dwell)
        n += 1
    return foreground + [ForegroundChange(t, None)], arrivals, flows


def foreground(seed: int) -> Workload:
    rng = random.Random(seed)
    end = 1800.0
    fg, arrivals, flows = _pages(rng, 30.0, end - 120.0, (30.0, 120.0), ("nataraj", "gana", "note", "chat", "home"))
    relay = [_note(rng, t, f"extract:relay#{i}", "extract:relay") for i, t in enumerate(_poisson(rng, 1 / 20, 0.0, end))]
    flows += [
        _backlog(rng, "nataraj", "nataraj", CHAT_MODEL, 0.0, end, 4, CARD_PROMPT, CARD),
        _backlog(rng, "gana:g1", "gana", GEMMA3, 0.0, end, 1, GANA_PROMPT, GANA_OUT, (1.0, 3.0)),
    ]
    return Workload("foreground", seed, "the user moves between pages while background work runs",
                    arrivals=tuple(sorted(arrivals + relay, key=lambda a: a.t)), flows=tuple(flows),
                    foreground=tuple(fg))


def mixed_day(seed: int) -> Workload:
    rng = random.Random(seed)
    hour, end = 3600.0, 24 * 3600.0
    arrivals = [_note(rng, t, f"extract:relay#{i}", "extract:relay")
                for i, t in enumerate(_poisson(rng, 1 / 30, 0.0, end))]
    arrivals += [_note(rng, 2 * hour + i, f"extract:backfill#{i}", "extract:backfill") for i in range(500)]
    arrivals += _cron(rng, "gana:news", GEMMA3, hour, 0.0, end) + _cron(rng, "gana:todo", CHAT_MODEL, hour / 2, 0.0, end)
    flows = [_backlog(rng, "nataraj", "nataraj", CHAT_MODEL, 0.0, end, 3, CARD_PROMPT, CARD)]
    for i, start in enumerate(sorted(rng.uniform(0.0, end - hour) for _ in range(6))):
        producer, model = (("gana:research", GEMMA3), ("gana:digest", CHAT_MODEL))[i % 2]
        rounds = _steps(rng, rng.randint(20, 60), GANA_PROMPT, GANA_OUT, (1.0, 3.0))
        flows.append(Flow(f"{producer}.{i}", "gana", model, start, rounds))
    foreground: list[ForegroundChange] = []
    for i, start in enumerate(sorted(rng.uniform(8 * hour, 23 * hour) for _ in range(12))):
        fg, arr, fl = _pages(rng, start, start + rng.uniform(300.0, 1200.0), (30.0, 180.0),
                             ("nataraj", "gana", "note", "chat", "chat"), first=100 * i)
        foreground += fg
        arrivals += arr
        flows += fl
    return Workload("mixed_day", seed, "24 h, two models: Nataraj, Gana sessions and crons, extracts, user sessions",
                    arrivals=tuple(sorted(arrivals, key=lambda a: a.t)), flows=tuple(flows),
                    foreground=tuple(sorted(foreground, key=lambda c: c.t)))


def _busy(rng: random.Random, end: float, natarajs: int, nataraj_depth: int, ganas: int, gana_depth: int,
          gana_model: str, chats: int = 5) -> tuple[Flow, ...]:
    """Nataraj producers and Gana loops keeping jobs queued until `end`, and `chats` conversations."""
    flows = [_backlog(rng, f"nataraj:{i}", "nataraj", CHAT_MODEL, 0.0, end, nataraj_depth, CARD_PROMPT, CARD)
             for i in range(natarajs)]
    flows += [_backlog(rng, f"gana:{i}", "gana", gana_model, 0.0, end, gana_depth, GANA_PROMPT, GANA_OUT)
              for i in range(ganas)]
    starts = sorted(rng.uniform(60.0, end - 300.0) for _ in range(chats))
    flows += [_chat(rng, f"chat:{i}", start, rng.randint(2, 4)) for i, start in enumerate(starts)]
    return tuple(flows)


def pool(seed: int) -> Workload:
    return Workload("pool", seed, "saturating: 3 Nataraj and 3 Gana producers on two models, 2 jobs queued "
                    "each, for 30 min; five chats", flows=_busy(random.Random(seed), 1800.0, 3, 2, 3, 2, GEMMA3))


def pool_chats(seed: int) -> Workload:
    return Workload("pool_chats", seed, "saturating as `pool`, for 2 h; 34 chat conversations",
                    flows=_busy(random.Random(seed), 7200.0, 3, 2, 3, 2, GEMMA3, chats=34))


def backfill_bulk(seed: int) -> Workload:
    return _backfill(seed, "backfill_bulk", "500 notes to extract, submitted at once at 10 s, beside Nataraj "
                     "and a Gana for 2 h", lambda i: 10.0, 7200.0)


def saturate(seed: int) -> Workload:
    return Workload("saturate", seed, "saturating, one model: 4 Nataraj producers keeping 8 cards queued and 4 "
                    "Gana loops keeping 2 rounds, for 30 min; five chats",
                    flows=_busy(random.Random(seed), 1800.0, 4, 8, 4, 2, CHAT_MODEL))


# -- short ones, to play on the real runtime beside their simulation (`replay`) ----------
def issue118_short(seed: int) -> Workload:
    flows, foreground = _deck_and_chats(random.Random(seed), 150.0, 3, (15.0, 80.0), 5.0, (3, 3), 60.0)
    return Workload("issue118_short", seed, "2.5 min of issue118: Nataraj fills 3 cards, chat opens twice",
                    flows=tuple(flows), foreground=tuple(foreground))


def swaps_short(seed: int) -> Workload:
    """Chat and Nataraj on the chat model, a Gana agent loop on the other one; the user
    opens the chat, then the Gana's page (T1: it swaps at once), then leaves."""
    rng = random.Random(seed)
    end = 180.0
    chat_at = 40.0 + rng.uniform(0.0, 5.0)
    flows = (
        _backlog(rng, "nataraj", "nataraj", CHAT_MODEL, 0.0, end, 2, CARD_PROMPT, CARD),
        _backlog(rng, "gana:g1", "gana", GEMMA3, 0.0, end, 1, GANA_PROMPT, GANA_OUT, (1.0, 3.0)),
        _chat(rng, "chat:0", chat_at, 3),
    )
    foreground = (ForegroundChange(0.0, "nataraj"), ForegroundChange(chat_at - 2.0, "chat"),
                  ForegroundChange(120.0, "gana"), ForegroundChange(150.0, None))
    return Workload("swaps_short", seed, "3 min: chat and Nataraj on SmolLM2, a Gana loop on Gemma, page changes",
                    flows=flows, foreground=foreground)


WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "issue118": issue118, "backfill": backfill, "ganas": ganas, "foreground": foreground, "mixed_day": mixed_day,
}
#: Minutes long, for the real runtime (`uniun-ray bench --real`); not in the simulated bench.
SHORT_WORKLOADS: dict[str, Callable[[int], Workload]] = {"issue118_short": issue118_short, "swaps_short": swaps_short}
#: For a pool of devices (`uniun-ray bench --devices`); not in the one-device bench.
POOL_WORKLOADS: dict[str, Callable[[int], Workload]] = {"pool": pool}
#: For a chat p99 on one device (`benchmarks/sim_bench.py`, "swaps"): many chats.
SWAP_WORKLOADS: dict[str, Callable[[int], Workload]] = {"pool_chats": pool_chats}
#: For devices with slots (`uniun-ray bench --slots`), with issue118; not in the one-slot bench.
SLOT_WORKLOADS: dict[str, Callable[[int], Workload]] = {"issue118": issue118, "backfill_bulk": backfill_bulk,
                                                        "saturate": saturate}


def generate(name: str, seed: int = 1) -> Workload:
    known = {**WORKLOADS, **SHORT_WORKLOADS, **POOL_WORKLOADS, **SWAP_WORKLOADS, **SLOT_WORKLOADS}
    try:
        return known[name](seed)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(known)}") from None
