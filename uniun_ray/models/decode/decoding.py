"""One run's decoding, from transformers' own parts: what shapes the next token, what ends the run.

The engine keeps its own decode loop (it buys chunked prefill, a cancel check before every
forward pass, and exact resume), but not its own sampling or stop rules: the next token comes
from a ``LogitsProcessorList`` built as ``model.generate`` builds it, from the model's
``generation_config`` updated by the request, and the run ends when a ``StoppingCriteriaList``
says so (EOS, max length and stop strings are transformers' criteria; the scheduler's revoke is
one more). So a greedy run is token-identical to ``model.generate``, and a seeded sampled run
draws exactly what ``generate`` draws after ``torch.manual_seed`` with the same seed.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (EosTokenCriteria, LogitsProcessorList, MaxLengthCriteria,
                          RepetitionPenaltyLogitsProcessor, StoppingCriteria, StoppingCriteriaList,
                          StopStringCriteria, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from .logits import shaping
from ..requests.request import GenerateRequest


class CancelCriteria(StoppingCriteria):
    """The scheduler's revoke as a stopping criterion. Another thread sets the flag; the engine
    asks before every forward pass (prefill chunks too) and after every token."""

    def __init__(self, flag: Any) -> None:
        self.flag = flag

    def is_set(self) -> bool:
        return self.flag.is_set()

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.is_set(), dtype=torch.bool, device=input_ids.device)


#: What each criterion's firing means, as ``GenerationResult.finish_reason``.
_REASONS = {CancelCriteria: "cancel", EosTokenCriteria: "eos", StopStringCriteria: "stop",
            MaxLengthCriteria: "length"}


@dataclass
class Decoding:
    """The processors, the sampler and the stopping criteria of one run."""

    processors: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None
    stopping: StoppingCriteriaList
    cancel: CancelCriteria

    def next_token(self, sequence: torch.LongTensor, logits: torch.Tensor) -> int:
        """Choose the token after ``sequence`` ([1, length], on the CPU) from the model's last
        ``logits``, brought to the CPU in float32 as ``generate`` does before its processors."""
        scores = self.processors(sequence, logits.to(dtype=torch.float32, device=sequence.device)[None])
        if not self.do_sample:
            return int(torch.argmax(scores, dim=-1).item())
        probabilities = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probabilities, 1, generator=self.generator).item())

    def finish_reason(self, sequence: torch.LongTensor) -> str | None:
        """Why the run ends after the last token of ``sequence``, or None if it goes on."""
        if not bool(self.stopping(sequence, None).any()):
            return None
        for criterion in self.stopping:  # the first that fires names it; cancel comes first
            if bool(criterion(sequence, None).any()):
                return _REASONS[type(criterion)]
        return "stop"


def decoding(model: Any, tokenizer: Any, request: GenerateRequest, prompt_tokens: int,
             eos_ids: frozenset[int], cancel_flag: Any, device: torch.device) -> Decoding:
    """Everything that decides one run's tokens and its end, for a context of ``prompt_tokens``
    (a resumed run's ``resume_tokens`` included: they are output to OpenAI's processors)."""
    config = generation_config(model, request)
    output_start = prompt_tokens - len(request.resume_tokens)
    chain = processors(config, shaping(request, tokenizer, eos_ids, output_start))
    cancel = CancelCriteria(cancel_flag)
    stopping = StoppingCriteriaList([cancel, EosTokenCriteria(sorted(eos_ids)),
                                     MaxLengthCriteria(prompt_tokens + request.max_new_tokens)])
    if request.stop:
        stopping.append(StopStringCriteria(tokenizer, list(request.stop)))
    generator = None
    if config.do_sample and request.seed is not None:   # sampling runs on the CPU (see next_token)
        generator = torch.Generator().manual_seed(request.seed)
    return Decoding(chain, bool(config.do_sample), generator, stopping, cancel)


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
    only) temperature, top-k, top-p."""
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
    return chain


class StopText:
    """Text-side stop strings: holds back text that may be the start of a stop string, and cuts
    the text before the first one (OpenAI's ``stop``: the returned text does not contain it)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """The part of ``piece`` (with what was held) that is safe to emit now."""
        if not self._stops or self.stopped:
            return "" if self.stopped else piece
        text = self._held + piece
        found = [index for index in (text.find(stop) for stop in self._stops) if index >= 0]
        if found:
            self._held, self.stopped = "", True
            return text[: min(found)]
        keep = max((n for stop in self._stops for n in range(1, min(len(stop), len(text)) + 1)
                    if text.endswith(stop[:n])), default=0)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is held, at the end of a run that no stop string ended."""
        held, self._held = self._held, ""
        return held
