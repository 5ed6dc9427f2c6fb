"""How a loaded model's forward pass is called, and the prefill pass that extends a run's own cache.

The decode step over a batch's rows is the rows' (``rows.Rows.decode``: padded, or static with
graphs); a prompt's chunk is read alone, into the run's own cache, here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class Inputs(NamedTuple):
    """What a decode step feeds, on the device: row i's ``tokens[i]`` at ``positions[i]`` (its
    tokens so far), and ``longest``, the most tokens a row holds after the step (its positions'
    largest plus one, known without reading them back). A tuple: made every step."""

    tokens: torch.Tensor
    positions: torch.Tensor
    longest: int

    @classmethod
    def of(cls, tokens: list[int], positions: list[int], device: torch.device) -> "Inputs":
        return cls(torch.tensor(tokens, device=device), torch.tensor(positions, device=device), max(positions) + 1)


@dataclass(frozen=True)
class Runner:
    """A loaded model and how its forward pass is called: the cache keyword transformers
    expects of it, and keywords every pass takes (``logits_to_keep``)."""

    model: Any
    cache_arg: str
    kwargs: dict = field(default_factory=dict)

    def prefill(self, ids: list[int], cache: Any, device: torch.device) -> tuple[torch.Tensor, Any]:
        """One forward pass over ``ids`` extending ``cache``: the last position's logits and the cache."""
        with torch.inference_mode():
            output = self.model(input_ids=torch.tensor([ids], device=device), use_cache=True,
                                **{self.cache_arg: cache}, **self.kwargs)
        return output.logits[0, -1], getattr(output, self.cache_arg)
