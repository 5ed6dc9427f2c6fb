"""One run's decoding, from transformers' own parts: what shapes the next token, what ends the run.

The engine keeps its own decode loop (it buys chunked prefill, a cancel check before every
forward pass, and exact resume), but not its own sampling or stop rules: the next token comes
from a ``LogitsProcessorList`` built as ``model.generate`` builds it, from the model's
``generation_config`` updated by the request, and the run ends when transformers' criteria say
so (the scheduler's revoke is one more). A batch applies them to all its rows at once
(``choice``): rows of equal settings in one call of their processors, the end-of-sequence and
length checks in one over the batch. So a greedy run is token-identical to ``model.generate``; a
sampled run draws from the distribution ``generate`` draws from, and a seeded one draws the
same tokens whatever runs beside it (its draws are keyed by its seed and position).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          StoppingCriteria, StopStringCriteria, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from .logits import shaping
from ..requests.request import GenerateRequest

#: Processors that keep no state of their own and treat each row of a batch alike: rows whose
#: chains hold only these, with equal settings, are one call of the chain (``Decoding.key``).
SHARED = (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
          MinPLogitsWarper)


class CancelCriteria(StoppingCriteria):
    """The scheduler's revoke as a stopping criterion. Another thread sets the flag; the engine
    asks before every forward pass (prefill chunks too; a batch reads its rows' flags once a
    step, ``batch.Batch``)."""

    def __init__(self, flag: Any) -> None:
        self.flag = flag

    def is_set(self) -> bool:
        return self.flag.is_set()

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.is_set(), dtype=torch.bool, device=input_ids.device)


@dataclass
class Decoding:
    """The processors, the sampler and the stopping criteria of one run. ``key``: equal for runs
    whose tokens a batch may choose in one call of ``processors`` (None: a run of its own)."""

    processors: LogitsProcessorList
    do_sample: bool
    seed: int | None
    cancel: CancelCriteria
    eos_ids: frozenset[int]
    max_length: int
    stop: StopStringCriteria | None = None
    key: Hashable | None = field(init=False)

    def __post_init__(self) -> None:
        self.key = _key(self.processors, self.do_sample)

    def stopped(self, ids: list[int]) -> bool:
        """Whether a stop string ends the run after the last of ``ids`` (the criterion reads
        only the last few)."""
        if self.stop is None:
            return False
        return bool(self.stop(torch.tensor([ids[-self.stop.maximum_token_len:]]), None).any())


def _key(chain: LogitsProcessorList, do_sample: bool) -> Hashable | None:
    if not all(type(processor) in SHARED for processor in chain):
        return None
    return do_sample, tuple((type(processor), tuple(sorted(vars(processor).items()))) for processor in chain)


def decoding(model: Any, tokenizer: Any, request: GenerateRequest, prompt_tokens: int,
             eos_ids: frozenset[int], cancel_flag: Any) -> Decoding:
    """Everything that decides one run's tokens and its end, for a context of ``prompt_tokens``
    (a resumed run's ``resume_tokens`` included: they are output to OpenAI's processors)."""
    config = generation_config(model, request)
    output_start = prompt_tokens - len(request.resume_tokens)
    chain = processors(config, shaping(request, tokenizer, eos_ids, output_start))
    stop = StopStringCriteria(tokenizer, list(request.stop)) if request.stop else None
    return Decoding(chain, bool(config.do_sample), request.seed if config.do_sample else None,
                    CancelCriteria(cancel_flag), eos_ids, prompt_tokens + request.max_new_tokens, stop)


def generation_config(model: Any, request: GenerateRequest) -> Any:
    """The model's ``generation_config`` with the request's sampling fields applied. An explicit
    temperature decides between greedy (0) and sampling (> 0); without one the model's own
    ``do_sample`` does."""
    config = copy.deepcopy(model.generation_config)
    sampling = request.sampling
    if sampling.get("temperature") == 0:
        sampling.pop("temperature")
        config.do_sample = False
    elif "temperature" in sampling:
        config.do_sample = True
    config.update(**sampling)
    return config


def processors(config: Any, shaping: list = ()) -> LogitsProcessorList:
    """As ``GenerationMixin._get_logits_processor`` builds them for these fields, in its order:
    penalties first, then the request's OpenAI ``shaping`` (``logits.shaping``), then (sampling
    only) temperature, top-k, top-p, min-p."""
    chain = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty=config.repetition_penalty))
    chain.extend(shaping)
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            chain.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            chain.append(TopKLogitsWarper(top_k=config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            chain.append(TopPLogitsWarper(top_p=config.top_p))
        if config.min_p is not None:
            chain.append(MinPLogitsWarper(min_p=config.min_p))
    return chain


class StopText:
    """Text-side stop strings: holds back text that may be the start of a stop string, and cuts
    the text before the first one (OpenAI's ``stop``: the returned text does not contain it)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """The part of ``piece`` (with what was held) that is safe to emit now."""
        if not self.stops or self.stopped:
            return "" if self.stopped else piece
        text = self._held + piece
        found = [index for index in (text.find(stop) for stop in self.stops) if index >= 0]
        if found:
            self._held, self.stopped = "", True
            return text[: min(found)]
        keep = max((n for stop in self.stops for n in range(1, min(len(stop), len(text)) + 1)
                    if text.endswith(stop[:n])), default=0)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is held, at the end of a run that no stop string ended."""
        held, self._held = self._held, ""
        return held
