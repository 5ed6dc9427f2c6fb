"""Every row's next token, chosen on the device in a number of tensor ops that does not grow with the rows.

A step's host work must not grow with its rows: on a GPU the host would otherwise spend a step's
time launching one row's small kernels after another while the device waits. So:

* Rows whose decodings are alike (the same transformers processors with the same settings:
  ``decoding.Decoding.key``; the usual case, every row on the model's ``generation_config``) are
  one group: one call of their ``LogitsProcessorList`` over the group's [rows, vocabulary]
  scores, as ``generate`` calls it over a batch. A row with a processor that keeps state of its
  own (OpenAI's penalties, logit_bias, a grammar: ``logits``) is a group of its own.
* A greedy group takes the argmax; a sampled group draws one token a row by inverse CDF over the
  processed probabilities (the distribution ``torch.multinomial`` draws from), with one uniform
  number per row.
* A seeded row's uniform is a hash of its seed and its position (the tokens before it): its
  draws depend on its seed and its own tokens only, never on the rows beside it, and need no
  generator of its own (a loop over rows). A row without a seed takes its uniform from torch's
  generator of the device, one ``rand`` for the batch.
* Only the chosen ids come to the host, in one copy, and what ends a row is decided from them
  for the batch at once: an end-of-sequence token by one set check over the step's ids (in C,
  not a row at a time), its last token by the step each row reaches its length limit, known
  when the rows were set (a lookup a step). (Its cancel flag is host state: the batch reads the
  rows' flags once a step, before the forward pass.)
* The next step's inputs stay on the device: the chosen ids are the tokens it feeds and the
  rows' lengths its positions (``inputs``), so a step builds no tensor from Python lists.

The processors read the rows' tokens ([rows, longest], on the device, kept here from step to
step); a row shorter than the longest is filled with an id past the vocabulary, which
transformers' repetition penalty ignores. A row with processors of its own reads exactly its
own tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .decoding import Decoding
from ..runner.forward import Inputs

if TYPE_CHECKING:
    from .sequence import Sequence

_MASK = 0xFFFFFFFF
_PAD = 2**31 - 1        # an id past any vocabulary
#: Columns the rows' tokens grow by when the longest reaches the end of them.
_ROOM = 64
#: Sizes of the vocabulary's blocks ``_argmax`` tries, largest first.
_BLOCKS = (256, 128, 64, 32)
_MIX = 0x45D9F3B        # below 2**31: a 32-bit value times it stays within int64


class Choice:
    """How a fixed set of rows (a batch's, in row order) choose their tokens, step after step;
    made again when a row joins or leaves."""

    def __init__(self, sequences: list[Sequence], device: torch.device) -> None:
        self._device = device
        keyed: dict = {}
        for row, sequence in enumerate(sequences):
            key = sequence.decoding.key
            keyed.setdefault(("alone", row) if key is None else key, []).append(row)
        decodings = [sequence.decoding for sequence in sequences]
        lengths = [sequence.length for sequence in sequences]
        whole = len(keyed) == 1
        self._groups = [_Group(rows, decodings[rows[0]], None if whole else torch.tensor(rows, device=device),
                               lengths[rows[0]] - max(lengths)) for rows in keyed.values()]
        # each row's last token's position (its length less one): the next step feeds it there
        self._positions = torch.tensor([length - 1 for length in lengths], device=device)
        self._sampled = any(decoding.do_sample for decoding in decodings)
        if self._sampled:
            seeds = [decoding.seed for decoding in decodings]
            self._seeds = _mix(torch.tensor([_fold(seed or 0) for seed in seeds], device=device))
            self._seeded = torch.tensor([seed is not None for seed in seeds], device=device)
        self._width = max(lengths)
        self._ids = None
        if any(group.decoding.processors for group in self._groups):
            self._ids = torch.tensor([sequence.ids + [_PAD] * (self._width + _ROOM - length)
                                      for sequence, length in zip(sequences, lengths)], device=device)
        self._eos = decodings[0].eos_ids
        # a row ends with the token that makes it as long as its decoding allows: by the step
        self._limits: dict[int, list[int]] = {}
        for row, (decoding, length) in enumerate(zip(decodings, lengths)):
            self._limits.setdefault(max(1, decoding.max_length - length), []).append(row)
        self._steps = 0
        self._tokens = torch.tensor([sequence.ids[-1] for sequence in sequences], device=device)

    def inputs(self) -> Inputs:
        """What the rows feed in the next step: each one's last token, at its position (tensors
        the step after it changes in place: read them within the step)."""
        return Inputs(self._tokens, self._positions, self._width)

    def step(self, logits: torch.Tensor) -> tuple[list[int], dict[int, str]]:
        """Each row's token from its ``logits`` ([rows, vocabulary], on the device), in one copy
        to the host, and the rows that end with it, by why ("eos", "length")."""
        chosen = self._choose(logits)
        self._positions += 1
        if self._ids is not None:
            if self._width == self._ids.shape[1]:
                self._ids = torch.cat([self._ids, torch.full((len(self._ids), _ROOM), _PAD, device=self._device)], 1)
            self._ids.scatter_(1, self._positions[:, None], chosen[:, None])
        self._tokens = chosen
        self._width += 1
        self._steps += 1
        tokens = chosen.tolist()       # the step's one read, after the next step's inputs are queued
        ends = dict.fromkeys(self._limits.get(self._steps, ()), "length")
        if not self._eos.isdisjoint(tokens):
            ends |= {row: "eos" for row, token in enumerate(tokens) if token in self._eos}
        return tokens, ends

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        uniforms = self._uniforms() if self._sampled else None
        if len(self._groups) == 1:
            return self._groups[0].choose(logits, self._group_ids(self._groups[0]), uniforms)
        chosen = torch.empty(logits.shape[0], dtype=torch.long, device=self._device)
        for group in self._groups:
            index = group.index
            chosen.index_copy_(0, index, group.choose(logits[index], self._group_ids(group),
                                                      None if uniforms is None else uniforms[index]))
        return chosen

    def _group_ids(self, group: _Group) -> torch.Tensor | None:
        """The tokens a group's processors read: a row of its own reads exactly its own."""
        if self._ids is None or not group.decoding.processors:
            return None
        if group.decoding.key is None:
            row = group.rows[0]
            return self._ids[row : row + 1, : self._width + group.shorter]
        ids = self._ids[:, : self._width]
        return ids if group.index is None else ids[group.index]

    def _uniforms(self) -> torch.Tensor:
        """One number in [0, 1) a row: a seeded row's from its seed and position, the others' drawn."""
        keyed = _mix(self._seeds ^ (self._positions + 1)) >> 8     # keyed by the row's length
        drawn = torch.rand(keyed.shape, device=self._device)
        return torch.where(self._seeded, keyed.float() * 2.0**-24, drawn)


class _Group:
    """Rows that choose alike: one call of their processors, then argmax or one draw a row."""

    def __init__(self, rows: list[int], decoding: Decoding, index: torch.Tensor | None, shorter: int) -> None:
        """``shorter``: how much shorter than the longest row its first row is (every row grows
        by one a step): the tokens a group of one row reads are exactly its own."""
        self.rows, self.decoding, self.index, self.shorter = rows, decoding, index, shorter

    def choose(self, logits: torch.Tensor, ids: torch.Tensor | None, uniforms: torch.Tensor | None) -> torch.Tensor:
        decoding = self.decoding
        if not decoding.processors and not decoding.do_sample:
            return _argmax(logits)
        scores = decoding.processors(ids, logits.float()) if decoding.processors else logits.float()
        if not decoding.do_sample:
            return _argmax(scores)
        cdf = torch.softmax(scores, -1).cumsum_(-1)
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
        return tokens.clamp_(max=scores.shape[-1] - 1)


def _argmax(scores: torch.Tensor) -> torch.Tensor:
    """``argmax(-1)``, the first of equal maxima as ``generate``'s, in two passes a CPU vectorizes:
    the maximum of each block of the vocabulary (``amax``), the first block holding the row's
    maximum, then the first maximum inside that block. A CPU's ``max``/``argmax`` with indices
    walks the vocabulary without its vector units, several times slower over 64 rows; a
    vocabulary no block size divides takes ``max``'s indices (the first of equal maxima too)."""
    rows, vocabulary = scores.shape
    block = next((size for size in _BLOCKS if vocabulary % size == 0), None)
    if block is None:
        return scores.max(-1).indices
    blocks = scores.view(rows, vocabulary // block, block)
    first = blocks.amax(-1).argmax(-1)
    return first * block + blocks[torch.arange(rows, device=scores.device), first].argmax(-1)


def _fold(seed: int) -> int:
    """A seed of any size as 32 bits (on the host, once a row)."""
    folded = 0
    while seed:
        folded ^= seed & _MASK
        seed >>= 32
    return folded


def _mix(values: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each of ``values`` (int64 in [0, 2**32)), on the device."""
    for _ in range(2):
        values = ((values ^ (values >> 16)) * _MIX) & _MASK
    return values ^ (values >> 16)
