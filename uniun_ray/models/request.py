"""What a generation asks for, validated where it is built, and how it ended.

Kept apart from the engine (and from torch) so that clients, producers, the CLI and the
runtime can build requests and read results without importing the model stack.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation: a prompt or chat messages, and how to continue a revoked job.

    Exactly one of ``prompt`` and ``messages`` is given. ``messages`` needs a model with a chat
    template. A plain ``prompt`` sent to a chat model is wrapped as a single user turn, because
    chat models answer raw text poorly; on a completion model it is continued as is.

    Resuming a revoked job, the engine prefills prompt + what the job already produced and
    returns only the new text. Give that output as one of:

    * ``resume_tokens``: the token ids from the revoked run's ``GenerationResult.token_ids``.
      Exact: greedy decoding then yields the same text as an uninterrupted run (in float32; in
      lower precision a recomputed prefill can round differently and flip a near-tie).
    * ``resume_text``: the text produced so far. It is re-tokenized together with the prompt,
      which may split it into different tokens than the model produced, so the continuation can
      differ from an uninterrupted run. Use it when the token ids are not at hand.

    Sampling, as transformers' ``generate`` reads it: ``temperature`` 0 is greedy (deterministic);
    above 0 samples, shaped by ``top_k`` (0: off), ``top_p`` (1: off) and ``repetition_penalty``
    (1: off). A field left None takes the model's ``generation_config`` value (so a model whose
    config says ``do_sample`` samples by default; the embedded ones are greedy). ``seed`` makes a
    sampled run repeatable. ``stop``: strings that end the run; the text returned stops before
    the first of them (OpenAI's ``stop``).
    """

    prompt: str | None = None
    messages: list[dict] | None = None
    max_new_tokens: int = 128
    resume_text: str = ""
    resume_tokens: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a str, got {type(self.prompt).__name__}")
        if self.messages is not None:
            _check_messages(self.messages)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.resume_text, str):
            raise ValueError(f"resume_text must be a str, got {type(self.resume_text).__name__}")
        object.__setattr__(self, "resume_tokens", _token_tuple(self.resume_tokens))
        if self.resume_text and self.resume_tokens:
            raise ValueError("give resume_tokens or resume_text, not both")
        _check_optional(self.temperature, "temperature", "a finite number >= 0", lambda v: _is_real(v) and 0 <= v)
        _check_optional(self.top_p, "top_p", "a number in (0, 1]", lambda v: _is_real(v) and 0 < v <= 1)
        _check_optional(self.top_k, "top_k", "an int >= 0", lambda v: _is_int(v) and v >= 0)
        _check_optional(self.repetition_penalty, "repetition_penalty", "a finite number > 0",
                        lambda v: _is_real(v) and v > 0)
        _check_optional(self.seed, "seed", "an int >= 0", lambda v: _is_int(v) and v >= 0)
        object.__setattr__(self, "stop", _stop_tuple(self.stop))

    @property
    def sampling(self) -> dict:
        """The sampling fields that were given, as ``GenerationConfig`` names them."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "repetition_penalty": self.repetition_penalty}
        return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True)
class GenerationResult:
    """How a run ended. Set on ``Generation.result`` once its iterator is exhausted or closed.

    ``text`` is the concatenation of the pieces yielded. ``token_ids`` are the tokens behind that
    text (the end-of-sequence token excluded); pass them as ``resume_tokens`` to continue after a
    revoke. On cancel, a token or two whose text was still incomplete (a multi-byte character
    split across tokens) is left out of both, so the resumed run recomputes it instead of the
    text losing a character. ``finish_reason`` is "eos", "length" (max_new_tokens reached),
    "stop" (a stop string; the text ends before it), "cancel" (the flag was set, or the
    consumer closed the iterator) or "error" (the model raised; the exception reached the
    consumer). ``ttft_s`` is the time from
    the start of the run (its first ``next``) to the first sampled token, None if none was.
    ``cached_tokens`` of the ``prompt_tokens`` came from the prefix cache; the rest were
    prefilled, in ``prefill_s`` (the cache lookup included; None: cancelled before the end).
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float | None
    total_s: float
    cached_tokens: int = 0
    prefill_s: float | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stopped_by_cancel(self) -> bool:
        return self.finish_reason == "cancel"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_optional(value: Any, name: str, what: str, valid) -> None:
    if value is not None and not (valid(value) and math.isfinite(value)):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _stop_tuple(stop: Any) -> tuple[str, ...]:
    """One string or a sequence of non-empty strings (OpenAI accepts both)."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"messages[{index}] must be a dict with str 'role' and str 'content', got {message!r}"
            )


def _token_tuple(tokens: Any) -> tuple[int, ...]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(f"resume_tokens must be a sequence of token ids, got {type(tokens).__name__}")
    if not all(_is_int(token) and token >= 0 for token in tokens):
        raise ValueError("resume_tokens must hold non-negative int token ids")
    return tuple(tokens)


