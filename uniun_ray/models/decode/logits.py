"""OpenAI's logit shaping as transformers ``LogitsProcessor`` objects, one set per request.

``presence_penalty`` / ``frequency_penalty`` (OpenAI's formula: a token's logit loses
``frequency * count + presence * (count > 0)`` for its count in the output so far),
``logit_bias`` (transformers' own ``SequenceBiasLogitsProcessor``, one-token sequences) and
``json_schema`` or a forced tool call (a grammar from llguidance masks every token that would
take the output off the schema or the call, so what comes out is valid JSON, or a valid call of
an offered tool, by construction, unless ``max_new_tokens`` or a stop string cuts it short).

Each processor sees one sequence (a [1, length] row: the prompt, then the output) and keeps its
own state (the grammar's parser), so a decode loop that runs several requests applies each
request's processors to its own row. The output starts at ``output_start``: a resumed run's
``resume_tokens`` are output (counted by the penalties, fed to the grammar), its
``resume_text`` is prompt to the penalties and fed to the grammar as text.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, SequenceBiasLogitsProcessor

from ..requests.request import GenerateRequest, InvalidRequest
from ..requests.tools import request_grammar


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the output (not the prompt)."""

    def __init__(self, presence: float, frequency: float, output_start: int) -> None:
        self.presence, self.frequency, self.start = presence, frequency, output_start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[0, self.start:]
        if output.numel():
            size = scores.shape[-1]
            counts = torch.bincount(output, minlength=size)[:size].to(scores.dtype)
            scores = scores - (self.frequency * counts + self.presence * (counts > 0))[None]
        return scores


class GrammarMask(LogitsProcessor):
    """Keeps only the tokens a grammar allows next (llguidance's matcher, fed the output as it
    grows); once the grammar is complete only an end-of-sequence token is allowed. Text the
    grammar forces (a call's markers and name, a schema's keys) is written in the tokens the
    tokenizer itself would split it into (llguidance's fast-forward tokens), not in any split
    the mask allows: the conversation re-tokenized in the next turn then holds the same tokens,
    and the prefix cache reuses it through the forced text."""

    def __init__(self, tokenizer: Any, grammar: str, output_start: int, resumed_text: str = "",
                 field: str = "json_schema") -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar)
        if resumed_text:
            self.matcher.consume_tokens(tokenizer.tokenize_str(resumed_text))
        if self.matcher.is_error():
            raise InvalidRequest(f"the output's grammar cannot be followed: {self.matcher.get_error()}", field)
        self.eos = list(tokenizer.eos_tokens)
        self.start = output_start
        self.fed = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        new = input_ids[0, self.start + self.fed:].tolist()
        if new:
            self.matcher.consume_tokens(new)
            self.fed += len(new)
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        forced = [] if self.matcher.is_error() else self.matcher.compute_ff_tokens()
        if self.matcher.is_error():   # cannot happen to sampled tokens; end the run rather than babble
            allowed[self.eos] = True
        elif forced:                  # text the grammar forces, in the tokenizer's own tokens
            allowed[forced[0]] = True
        else:
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            size = min(len(bits), scores.shape[-1])
            allowed[:size] = torch.from_numpy(bits[:size].astype(bool))
        return scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))


def shaping(request: GenerateRequest, tokenizer: Any, eos_ids: frozenset[int], output_start: int) -> list:
    """The request's OpenAI processors, in vLLM's order: penalties, logit bias, then the grammar
    (last, so that only what it allows is left for the sampler)."""
    chain: list[LogitsProcessor] = []
    if request.presence_penalty or request.frequency_penalty:
        chain.append(OpenAIPenalties(request.presence_penalty or 0.0, request.frequency_penalty or 0.0, output_start))
    if request.logit_bias:
        chain.append(SequenceBiasLogitsProcessor({(token,): bias for token, bias in request.logit_bias.items()}))
    grammar = request_grammar(request, getattr(tokenizer, "chat_template", None))
    if grammar is not None:
        chain.append(GrammarMask(grammar_tokenizer(tokenizer, eos_ids), grammar, output_start, request.resume_text,
                                 "tool_choice" if request.forces_call else "json_schema"))
    return chain


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Any, eos_ids: frozenset[int]) -> Any:
    """llguidance's view of a Hugging Face tokenizer (about a second to build on a large
    vocabulary): made once per tokenizer and set of end tokens, kept while the tokenizer lives."""
    import llguidance.hf

    key = tuple(sorted(eos_ids))
    with _TOKENIZERS_LOCK:
        built = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in built:
            built[key] = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(key))
        return built[key]
