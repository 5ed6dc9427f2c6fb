"""A decode step is one tensor program: its host work does not grow with the rows.

Counts, with a ``TorchDispatchMode``, the torch ops one ``Batch`` step dispatches outside the
model's forward pass, and the reads of a tensor's values into Python (``_local_scalar_dense``:
``.item()``, ``int()``, ``bool()``; ``.tolist()``; a copy to the CPU from another device), at
1, 8 and 64 rows of the embedded `tiny` model in float32: the same op count at every row count
for a given set of distinct settings, and one read per step (the chosen token ids: what ends
a row is decided from them on the host). Sampled rows' draws are checked against transformers' own processors.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopPLogitsWarper)

from test_models import PROMPT, engine, loaded_engine, tiny_cache  # noqa: F401 (fixtures)
from uniun_ray.models import GenerateRequest
from uniun_ray.models.decode.batch import Batch
from uniun_ray.models.decode.choice import Choice
from uniun_ray.models.decode.decoding import CancelCriteria, Decoding, processors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from host_overhead import full_batch, ops_of_step  # noqa: E402 (benchmarks/ is not a package)

GREEDY = GenerateRequest(prompt=PROMPT, max_new_tokens=200)
SAMPLED = GenerateRequest(prompt=PROMPT, max_new_tokens=200, top_p=0.9, temperature=0.7, repetition_penalty=1.1)
SEEDED = GenerateRequest(prompt=PROMPT, max_new_tokens=200, top_p=0.9, temperature=0.7, repetition_penalty=1.1,
                         seed=3)
#: Each kind of row, and the requests its rows cycle through.
KINDS = {"greedy": [GREEDY], "sampled": [SAMPLED], "seeded": [SEEDED], "mix": [GREEDY, SAMPLED, SEEDED]}
ROWS = (1, 8, 64)


def counted_step(engine, kind: str, rows: int) -> tuple[int, int]:
    """(ops, reads) of a step in which all ``rows`` rows decode on: a step in which a sampled
    row drew its EOS is a step of fewer rows after it, so it is taken again (3 tries)."""
    for _ in range(3):
        requests = KINDS[kind]
        try:
            batch = full_batch(engine, lambda row: requests[row % len(requests)], rows)
        except RuntimeError as error:
            pytest.fail(f"{kind}: {error}")
        counted = ops_of_step(engine, batch)
        full = batch.rows == rows
        batch.close()
        if full:
            return counted
    pytest.fail(f"{kind}: a row ended in each of 3 counted steps of {rows} rows")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_steps_ops_do_not_grow_with_its_rows_and_it_reads_the_host_once(engine, kind, one_thread):
    """The ops and reads counted in one step (``host_overhead.StepCount``) of rows all decoding."""
    counts = {}
    for rows in ROWS if kind != "mix" else (3,) + ROWS[1:]:
        counts[rows], reads = counted_step(engine, kind, rows)
        assert reads == 1, f"{kind}, {rows} rows: {reads} reads into Python"
    assert len(set(counts.values())) == 1, f"{kind}: ops per step by rows {counts}"


def _rows(count: int, seed_of, ids: list[int], config) -> list[SimpleNamespace]:
    """``count`` rows of ``ids`` decoding as ``config`` says, row i seeded ``seed_of(i)``."""
    chain = processors(config)
    return [SimpleNamespace(ids=ids, length=len(ids), decoding=Decoding(
        chain, bool(config.do_sample), seed_of(row), CancelCriteria(threading.Event()), frozenset({0}), len(ids) + 20))
        for row in range(count)]


def test_sampled_rows_draw_from_the_distribution_of_transformers_processors():
    """The same logits in every one of DRAWS rows (seeds 0..DRAWS-1, one step): the tokens drawn
    against the probabilities of transformers' own processors, as ``generate`` builds them for
    top_p 0.9, temperature 0.7, repetition_penalty 1.1. Tolerance: Pearson's chi-square over the
    tokens expected at least 5 times below df + 6 * sqrt(2 df) (about 6 standard deviations:
    the draws are fixed by their seeds, so the test is deterministic; a wrong distribution,
    e.g. the temperature left out, scores hundreds of df); no token outside top-p drawn."""
    draws, vocabulary = 20000, 512
    logits = torch.randn(vocabulary, generator=torch.Generator().manual_seed(0))
    ids = [5, 17, 17, 300]
    config = GenerationConfig(do_sample=True, top_p=0.9, temperature=0.7, repetition_penalty=1.1)
    reference = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.7),
                                     TopPLogitsWarper(0.9)])
    expected = torch.softmax(reference(torch.tensor([ids]), logits[None].clone()), -1)[0].double()
    tokens, ends = Choice(_rows(draws, lambda row: row, ids, config), torch.device("cpu")).step(
        logits.expand(draws, vocabulary))
    counts = torch.bincount(torch.tensor(tokens), minlength=vocabulary).double()
    assert counts[expected == 0].sum() == 0 and ends == {}
    kept = expected * draws >= 5
    chi2 = float((((counts - expected * draws) ** 2) / (expected * draws))[kept].sum())
    df = int(kept.sum()) - 1
    assert df >= 10 and chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)


def test_a_seeded_rows_draw_depends_on_its_seed_and_position_only():
    """Alone or among 63 others (seeded otherwise, or not at all), seed 9 at one position draws
    the same token; at the next position, or with another seed, not always the same."""
    logits = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    config = GenerationConfig(do_sample=True, temperature=1.5)
    alone = Choice(_rows(1, lambda row: 9, [1, 2, 3], config), torch.device("cpu"))
    among = Choice(_rows(64, lambda row: 9 if row == 40 else (row if row % 2 else None), [1, 2, 3], config),
                   torch.device("cpu"))
    firsts = [alone.step(logits[40:41])[0][0] for alone in (alone,)] + [among.step(logits)[0][40]]
    assert firsts[0] == firsts[1]
    seconds = [alone.step(logits[40:41])[0][0], among.step(logits)[0][40]]
    assert seconds[0] == seconds[1]
    ten = [Choice(_rows(1, lambda row: 9, [1, 2, 3] + [4] * step, config), torch.device("cpu")).step(
        logits[40:41])[0][0] for step in range(10)]
    others = [Choice(_rows(1, lambda row: seed, [1, 2, 3], config), torch.device("cpu")).step(
        logits[40:41])[0][0] for seed in range(10)]
    assert len(set(ten)) > 1 and len(set(others)) > 1


@pytest.mark.parametrize("vocabulary", [49152, 151936, 32001, 7])
def test_greedy_choice_is_the_first_of_equal_maxima_as_argmax(vocabulary):
    """The blocked argmax (``choice._argmax``) against ``argmax(-1)``: maxima tied within a
    block, across blocks, at the ends of the vocabulary, and a vocabulary no block divides."""
    from uniun_ray.models.decode.choice import _argmax
    scores = torch.randn(6, vocabulary, generator=torch.Generator().manual_seed(vocabulary))
    ties = [(0, [1, 2]), (1, [3, vocabulary - 1]), (2, [vocabulary - 1]), (3, [0, vocabulary // 2]),
            (4, [vocabulary // 3, vocabulary // 3 + 1, vocabulary - 2])]
    for row, columns in ties:
        scores[row, columns] = 50.0
    assert torch.equal(_argmax(scores), scores.argmax(-1))


def test_rows_end_at_their_own_length_limits_and_at_an_end_of_sequence_token_first():
    """Rows of different lengths and limits (``_rows``: the limit is the length plus 20) end,
    each, with the token that makes it as long as its limit, "eos" winning when that token is
    an end-of-sequence token (0 here); the positions fed grow by one a step from each row's last."""
    config = GenerationConfig(do_sample=False)
    rows = _rows(1, lambda row: None, [5, 6, 7], config) + _rows(1, lambda row: None, [5] * 12, config)
    choice = Choice(rows, torch.device("cpu"))
    logits = torch.zeros(2, 16)
    logits[:, 3] = 1.0                                  # every step chooses token 3 ...
    seen = {}
    for step in range(1, 21):
        assert choice.inputs().positions.tolist() == [2 + step - 1, 11 + step - 1]
        if step == 20:
            logits[1] = torch.zeros(16)
            logits[1, 0] = 1.0                          # ... but row 1's 20th, an end of sequence
        tokens, ends = choice.step(logits)
        seen.update({row: (step, why) for row, why in ends.items()})
        assert choice.inputs().tokens.tolist() == tokens
    assert seen == {0: (20, "length"), 1: (20, "eos")}


def test_a_batch_counts_each_rows_steps_and_tokens_fed_when_it_leaves(engine):
    """A row's steps, the rows beside it in them, and the tokens its KV holds are counted by
    the batch and settled when it leaves: a run of 12 new tokens, 3 shorter ones beside it at first."""
    batch = Batch(engine)
    jobs = [batch.add(GenerateRequest(prompt=PROMPT, max_new_tokens=new), threading.Event()) for new in (12, 4, 4, 4)]
    batch.run()
    first = jobs[0].result
    assert first.finish_reason == "length" and len(first.token_ids) == 12
    steps = 11                                           # its first token came from its prompt
    assert first.mean_batch is not None and 1 < first.mean_batch <= 4
    assert jobs[0].sequence.steps == steps and jobs[0].sequence.fed == len(jobs[0].sequence.ids) - 1
