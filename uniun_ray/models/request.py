"""What a generation asks for, validated where it is built.

Kept apart from the engine (and from torch) so that clients, producers and the CLI can
build and check requests without importing the model stack.
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

    ``temperature`` 0 is greedy (deterministic); above 0 samples from the softmax at that
    temperature.
    """

    prompt: str | None = None
    messages: list[dict] | None = None
    max_new_tokens: int = 128
    resume_text: str = ""
    resume_tokens: tuple[int, ...] = ()
    temperature: float = 0.0

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
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


