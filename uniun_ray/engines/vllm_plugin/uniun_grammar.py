"""A request's grammar (a JSON Schema's, or a forced tool call's) as a logits processor inside
vLLM's server (the vLLM engine starts it with `--logits-processors uniun_grammar:GrammarMask`
and this folder on its PYTHONPATH). It runs on vLLM's own Python: it imports vLLM, llguidance and transformers, and
nothing of uniun_ray.

Why not vLLM's own structured outputs: a revoked job resumes as a new request of prompt +
produced ids, and vLLM's grammar would begin again at the resumed request's first token, with
half the JSON already in the prompt. This mask feeds the resumed ids (or, after a lost device,
the resumed text) to the grammar first, as the transformers engine's `GrammarMask` does
(`uniun_ray/models/decode/logits.py`: the same llguidance grammar), so a resumed job goes on inside
its JSON (or its tool call).

Text the grammar forces (a call's markers and name, a schema's keys) is written in the tokens the
tokenizer itself would split it into (llguidance's fast-forward tokens), as the transformers
engine writes it, so that a conversation rendered again re-tokenizes to what was generated.

A request asks for it through `vllm_xargs`: `uniun_grammar` (llguidance's grammar, as the
engine's `tools.request_grammar` writes it), `uniun_eos` (the end ids allowed once the grammar
is complete) and `uniun_resumed` (how many of
the prompt's last ids are resumed output) or `uniun_resumed_text`."""
from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor


class GrammarMask(AdapterLogitsProcessor):
    """Builds a `_Mask` for each request that names a grammar; the others pass untouched."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._folder = vllm_config.model_config.tokenizer
        self._tokenizers: dict[tuple[int, ...], object] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if args.get("uniun_grammar") is None:
            return None
        from llguidance import LLMatcher

        tokenizer = self._tokenizer(tuple(int(i) for i in args.get("uniun_eos") or ()))
        matcher = LLMatcher(tokenizer, args["uniun_grammar"])
        resumed_text = args.get("uniun_resumed_text") or ""
        if resumed_text:
            matcher.consume_tokens(tokenizer.tokenize_str(resumed_text))
        return _Mask(matcher, int(args.get("uniun_resumed") or 0), list(tokenizer.eos_tokens))

    def _tokenizer(self, eos: tuple[int, ...]):
        """llguidance's view of the model's tokenizer (a second or so on a large vocabulary),
        once per set of end ids."""
        if eos not in self._tokenizers:
            import llguidance.hf
            from transformers import AutoTokenizer

            self._tokenizers[eos] = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(self._folder),
                                                                 eos_token=list(eos) or None)
        return self._tokenizers[eos]


class _Mask:
    """One request's grammar: fed the resumed ids at its first step, then the output as it grows;
    keeps only the tokens the grammar allows next (only an end id once the JSON is complete)."""

    def __init__(self, matcher, resumed: int, eos: list[int]) -> None:
        self.matcher, self.resumed, self.eos, self.fed, self.started = matcher, resumed, eos, 0, False

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not self.started:
            self.started = True
            if self.resumed:
                self.matcher.consume_tokens(list(prompt_ids[-self.resumed:]))
        if len(output_ids) > self.fed:
            self.matcher.consume_tokens(list(output_ids[self.fed:]))
            self.fed = len(output_ids)
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
        forced = [] if self.matcher.is_error() else self.matcher.compute_ff_tokens()
        if self.matcher.is_error():   # cannot happen to the tokens it allowed: end the run
            allowed[self.eos] = True
        elif forced:                  # forced text, in the tokenizer's own tokens
            allowed[forced[0]] = True
        else:
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            size = min(len(bits), logits.shape[-1])
            allowed[:size] = torch.from_numpy(bits[:size].astype(bool))
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
