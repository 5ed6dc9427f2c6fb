"""The batched decode loop (issue 25): several jobs in one forward pass per step, each exactly as alone.

Runs the embedded `tiny` model in float32 (the fixtures of test_models: one conversion per module).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import MistralConfig

from test_models import LONG_PROMPT, PROMPT, engine, forwards, loaded_engine, run, tiny_cache  # noqa: F401 (fixtures)
from uniun_ray.models import GenerateRequest
from uniun_ray.models.decode.batch import Batch
from uniun_ray.models.kv.rows import batchable
from uniun_ray.models.decode.decoding import Decoding

#: Prompts of different lengths (so rows are padded differently), different lengths of output.
REQUESTS = [
    GenerateRequest(prompt=PROMPT, max_new_tokens=24),
    GenerateRequest(prompt=LONG_PROMPT[:300], max_new_tokens=9),
    GenerateRequest(prompt="class Stack:", max_new_tokens=31),
    GenerateRequest(prompt=LONG_PROMPT[:120] + " and so", max_new_tokens=17),
    GenerateRequest(prompt="import os\nimport sys\n", max_new_tokens=5),
    GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=12),
    GenerateRequest(prompt="# a comment", max_new_tokens=40),
    GenerateRequest(prompt="x = [i * i for i in", max_new_tokens=21),
]


@pytest.fixture
def logits_seen(monkeypatch):
    """The logits each token was chosen from, by the tokens before it. Token identity alone is a
    weak check on `tiny` (untrained, its attention barely moves its choices: wrong position ids
    still gave the same tokens); its logits moved by 4e-4 then, against 1e-7 done right."""
    seen: dict[tuple[int, ...], list[torch.Tensor]] = {}
    choose = Decoding.next_token

    def recording(self, sequence, logits):
        seen.setdefault(tuple(sequence[0].tolist()), []).append(logits.detach().float().cpu().clone())
        return choose(self, sequence, logits)

    monkeypatch.setattr(Decoding, "next_token", recording)
    return seen


def alone(engine, requests) -> list[tuple[int, ...]]:
    """Each request's tokens when it runs by itself, then an empty prefix cache."""
    tokens = [run(engine, request)[1].token_ids for request in requests]
    engine.resident.prefix.clear()
    return tokens


def drive(batch: Batch, arrivals: dict[int, list], events: dict[int, callable] | None = None) -> dict[int, int]:
    """Step the batch, adding ``arrivals[step]`` (request, cancel) and running ``events[step]``
    before that step; returns the most rows seen decoding together, per step."""
    jobs, widths, step = [], {}, 0
    while step <= max(arrivals) or batch.busy:
        for request, cancel in arrivals.get(step, []):
            jobs.append(batch.add(request, cancel))
        if events and step in events:
            events[step]()
        batch.step()
        widths[step] = batch.rows
        step += 1
    return jobs, widths


@pytest.mark.parametrize("count", [1, 3, 8])
def test_jobs_joining_and_leaving_at_different_steps_decode_as_alone(engine, monkeypatch, logits_seen, count):
    monkeypatch.setattr(engine, "prefill_chunk", 32)       # long prompts take several steps to join
    requests = REQUESTS[:count]
    expected = alone(engine, requests)
    batch = Batch(engine)
    arrivals = {3 * index: [(request, threading.Event())] for index, request in enumerate(requests)}
    jobs, widths = drive(batch, arrivals)
    assert [job.result.token_ids for job in jobs] == expected
    pairs = [seen for seen in logits_seen.values() if len(seen) == 2]      # alone, then batched
    assert len(pairs) == len(logits_seen) == sum(map(len, expected))
    assert max(float((alone - batched).abs().max()) for alone, batched in pairs) < 1e-5
    assert all(job.result.finish_reason == "length" and job.done.is_set() for job in jobs)
    assert all(job.result.text == "".join(job.pieces) for job in jobs)
    assert max(widths.values()) >= min(count, 4)                         # they did share steps
    assert engine._running == 0 and not batch.busy


def test_a_revoke_mid_decode_stops_that_job_only_and_its_resume_continues_exactly(engine, monkeypatch):
    monkeypatch.setattr(engine, "prefill_chunk", 32)
    requests = REQUESTS[:4]
    expected = alone(engine, requests)
    revoked = threading.Event()
    batch = Batch(engine)
    arrivals = {0: [(requests[0], threading.Event()), (requests[1], threading.Event())],
                1: [(requests[2], revoked), (requests[3], threading.Event())]}
    jobs, _ = drive(batch, arrivals, events={14: revoked.set})
    cut = jobs[2].result
    assert cut.stopped_by_cancel and 0 < cut.tokens < requests[2].max_new_tokens
    assert [job.result.token_ids for job in jobs[:2] + jobs[3:]] == expected[:2] + expected[3:]
    assert engine.describe()["kv_cache"]["preempted_entries"] == 1
    resume = GenerateRequest(prompt=requests[2].prompt, max_new_tokens=requests[2].max_new_tokens - cut.tokens,
                             resume_tokens=cut.token_ids)
    again, _ = drive(batch, {0: [(resume, threading.Event()), (requests[0], threading.Event())]})
    assert cut.token_ids + again[0].result.token_ids == expected[2]
    assert again[0].result.prompt_tokens - again[0].result.cached_tokens <= 2   # its KV was kept
    assert again[1].result.token_ids == expected[0]


def test_a_revoke_mid_prefill_stops_that_prefill_and_its_resume_matches(engine, monkeypatch):
    monkeypatch.setattr(engine, "prefill_chunk", 16)
    long = GenerateRequest(prompt="Cut in its prefill. " + LONG_PROMPT, max_new_tokens=10)
    others = REQUESTS[:2]
    expected = alone(engine, others + [long])
    revoked = threading.Event()
    batch = Batch(engine)
    arrivals = {0: [(others[0], threading.Event())], 1: [(long, revoked)], 2: [(others[1], threading.Event())]}
    jobs, _ = drive(batch, arrivals, events={5: revoked.set})     # a few chunks of `long` read by then
    cut = jobs[1].result
    assert cut.stopped_by_cancel and cut.tokens == 0 and cut.ttft_s is None
    assert [jobs[0].result.token_ids, jobs[2].result.token_ids] == expected[:2]
    again, _ = drive(batch, {0: [(long, threading.Event())]})
    assert again[0].result.token_ids == expected[2]
    assert again[0].result.cached_tokens >= 3 * 16                  # the chunks read before the revoke


def test_a_job_revoked_while_it_waits_for_a_row_does_no_work(engine):
    batch = Batch(engine, slots=1)
    revoked = threading.Event()
    first = batch.add(REQUESTS[0], threading.Event())
    second = batch.add(REQUESTS[1], revoked)
    batch.step()
    assert batch.rows == 1 and second.result is None
    revoked.set()
    batch.run()
    assert second.result.finish_reason == "cancel" and second.result.total_s >= 0 and second.pieces == []
    assert first.result.finish_reason == "length"


def test_stop_strings_and_the_stream_per_job(engine):
    request = GenerateRequest(prompt=PROMPT, max_new_tokens=40)
    whole = run(engine, request)[1]
    stop = whole.text[len(whole.text) // 2 :][:3]
    stopped = GenerateRequest(prompt=PROMPT, max_new_tokens=40, stop=(stop,))
    expected = run(engine, stopped)[1]
    engine.resident.prefix.clear()
    batch = Batch(engine)
    jobs = [batch.add(stopped, threading.Event()), batch.add(REQUESTS[2], threading.Event())]
    streamed = []
    while batch.step():
        streamed += jobs[0].take()
    streamed += jobs[0].take()
    assert jobs[0].result.finish_reason == "stop" and stop not in jobs[0].result.text
    assert "".join(streamed) == jobs[0].result.text == expected.text
    assert jobs[1].result.finish_reason == "length"


def test_load_is_refused_while_a_batch_holds_jobs(engine):
    batch = Batch(engine)
    batch.add(REQUESTS[0], threading.Event())
    with pytest.raises(RuntimeError, match="while a generation is running"):
        engine.load("smollm2-135m-instruct")
    batch.close()
    assert engine._running == 0 and not batch.busy


def test_only_plain_full_attention_caches_are_batched(engine):
    assert batchable(engine.resident.model) and Batch(engine).slots > 1

    class SlidingModel:
        config = MistralConfig(num_hidden_layers=2, sliding_window=8, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64)

    assert not batchable(SlidingModel())


def test_a_long_prompt_joins_one_chunk_per_step_while_the_others_decode(engine, monkeypatch, forwards):
    monkeypatch.setattr(engine, "prefill_chunk", 16)
    batch = Batch(engine)
    decoding = batch.add(GenerateRequest(prompt=PROMPT, max_new_tokens=60), threading.Event())
    batch.step()
    batch.add(GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=4), threading.Event())
    joining_steps = 0
    while batch.rows < 2:
        before, passes = decoding.sequence.length, forwards.count
        batch.step()
        assert decoding.sequence.length == before + 1 and forwards.count - passes == 2   # a chunk, a step
        joining_steps += 1
    assert joining_steps == -(-engine.check(GenerateRequest(prompt=LONG_PROMPT)) // 16)
    batch.close()


def test_a_seeded_sampled_job_draws_in_a_batch_what_it_draws_alone(engine):
    """Issue 35: a row's draws depend on its own seed and position only: its own generator, one
    draw per token, never the rows beside it (sampled too, seeded otherwise or not at all)."""
    seeded = GenerateRequest(prompt=PROMPT, max_new_tokens=20, temperature=1.2, seed=5)
    expected = alone(engine, [seeded])[0]
    beside = [GenerateRequest(prompt=LONG_PROMPT[:200], max_new_tokens=30, temperature=1.5, seed=6),
              GenerateRequest(prompt="class Stack:", max_new_tokens=25, temperature=1.5),
              GenerateRequest(prompt="import os", max_new_tokens=9, temperature=0.7, seed=5)]
    batch = Batch(engine)
    jobs, widths = drive(batch, {0: [(beside[0], threading.Event()), (beside[1], threading.Event())],
                                 2: [(seeded, threading.Event())], 4: [(beside[2], threading.Event())]})
    assert jobs[2].result.token_ids == expected and max(widths.values()) >= 3
    assert alone(engine, [seeded])[0] == expected


def test_a_chat_reads_its_prompt_in_one_pass_and_a_background_prompt_in_short_chunks(engine, monkeypatch, forwards):
    clock = engine.resident.clock
    monkeypatch.setattr(clock, "_chunk", 320.0)                            # a gated model's chunk, alone
    monkeypatch.setattr(clock, "observe", lambda tokens, seconds: None)    # and it stays so
    batch = Batch(engine)
    batch.add(GenerateRequest(prompt=PROMPT, max_new_tokens=200), threading.Event())
    batch.step()
    prompts = [" ".join(f"{word}{i}" for i in range(120)) for word in ("north", "south")]    # never cached
    chat = batch.add(GenerateRequest(prompt=prompts[0], max_new_tokens=4), threading.Event(), revocable=False)
    passes = forwards.count
    batch.step()
    assert batch.rows == 2 and forwards.count - passes == 2    # its whole prompt, then a step with it
    batch.step()
    background = batch.add(GenerateRequest(prompt=prompts[1], max_new_tokens=2), threading.Event())
    batch.step()
    assert 0 < background.sequence.fed <= 320 / 4          # cut to a few decode steps: the others wait
    batch.close()


def test_a_model_that_cannot_be_batched_runs_its_jobs_one_at_a_time(engine, monkeypatch):
    from uniun_ray.models.kv import rows

    expected = alone(engine, REQUESTS[:3])
    monkeypatch.setattr(rows, "batchable", lambda model: False)     # as a sliding-window model
    batch = Batch(engine, slots=8)
    assert batch.slots == 1 and not batch.batched
    jobs, widths = drive(batch, {0: [(request, threading.Event()) for request in REQUESTS[:3]]})
    assert [job.result.token_ids for job in jobs] == expected and max(widths.values()) == 1


def test_the_decode_loop_steps_jobs_added_from_many_threads_together_and_alone_when_idle(engine):
    """`DecodeLoop` (the ModelActor's): jobs added from several threads share steps, each ends as
    it would alone, a cancelled one leaves while the others go on, and the stepping thread ends
    when the batch is empty (a later job starts a new one)."""
    from uniun_ray.models.decode.loop import DecodeLoop

    requests = REQUESTS[:4]
    expected = alone(engine, requests)
    woken = threading.Semaphore(0)
    loop = DecodeLoop(engine, 8, woken.release)
    doomed = threading.Event()
    jobs: list = [None] * len(requests)

    def add(index: int) -> None:
        jobs[index] = loop.add(requests[index], threading.Event())

    adders = [threading.Thread(target=add, args=(i,)) for i in range(len(requests))]
    for adder in adders:
        adder.start()
    victim = loop.add(GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=200), doomed)
    for adder in adders:
        adder.join()
    woken.acquire(timeout=30)
    doomed.set()
    for job in jobs + [victim]:
        assert job.done.wait(60)
    assert [job.result.token_ids for job in jobs] == expected
    assert victim.result.finish_reason == "cancel" and victim.result.tokens < 200
    assert max(loop.batch_sizes) > 1 and loop.failure is None
    assert max(job.result.mean_batch for job in jobs) > 1
    for _ in range(1000):                  # the thread ends once the batch is empty
        if not loop._stepping:
            break
        time.sleep(0.01)
    assert not loop._stepping
    again = loop.add(requests[0], threading.Event())
    assert again.done.wait(60) and again.result.token_ids == expected[0]


def test_a_chat_joins_before_older_joiners_and_a_revoked_joiner_leaves_at_the_next_step(engine):
    """Jobs join one per step; a chat (not revocable) goes first, and a job revoked while it
    waits ends at the next step, not when its turn to join comes (issue 25: a chat's victim
    stopped ~10 steps late behind ten resuming jobs)."""
    batch = Batch(engine)
    waiting = [batch.add(request, threading.Event()) for request in REQUESTS[:4]]
    doomed = threading.Event()
    victim = batch.add(REQUESTS[4], doomed)
    chat = batch.add(GenerateRequest(prompt=PROMPT, max_new_tokens=4), threading.Event(), revocable=False)
    doomed.set()
    batch.step()
    assert victim.done.is_set() and victim.result.finish_reason == "cancel" and victim.result.tokens == 0
    assert batch.rows == 1 and chat.sequence.first_token_at is not None
    assert not any(job.sequence.first_token_at for job in waiting)
    batch.run()
    assert all(job.done.is_set() for job in waiting + [chat])


def test_a_chat_has_its_first_token_before_the_rows_it_revoked_leave(engine):
    """A chat that revokes the jobs beside it (R23) joins at the step they leave; their KV is
    copied out of the batch after its prefill, not before (its TTFT waits for none of it)."""
    batch = Batch(engine, slots=4)
    flags = [threading.Event() for _ in range(3)]
    companions = [batch.add(request, flag) for request, flag in zip(REQUESTS[:3], flags)]
    while batch.rows < 3:
        batch.step()
    seen = []
    batch._first_token = lambda: seen.append([job.done.is_set() for job in companions])
    for flag in flags[1:]:
        flag.set()
    batch.add(GenerateRequest(prompt=PROMPT, max_new_tokens=4), threading.Event(), revocable=False)
    batch.step()
    assert seen == [[False, False, False]]                          # the chat's first token came first
    assert [job.done.is_set() for job in companions] == [False, True, True]   # then they left, that step
    assert batch.rows == 2 and all(job.result.finish_reason == "cancel" for job in companions[1:])


#: Traffic around the one greedy question: prompts that share its first tokens (partial cache
#: hits), others that do not (misses), each a short answer.
OTHERS = ["Write a haiku about the sea.", "In one sentence, why is grass green?", "List three prime numbers.",
          "In one sentence, why is the sky blue? Answer like a pirate.", "What is 2 + 2?", "Name a color.",
          "Tell me a joke about cats.", "In one sentence, why is the sea salty?"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_greedy_question_gets_one_answer_whatever_the_cache_holds_and_the_rows_beside(dtype, monkeypatch):
    """Issue 35: asked 20 times amid random other traffic (1-8 rows beside it, the prefix cache
    hit, missed and cleared), the same temperature-0 request gets the same tokens with
    UNIUN_DETERMINISTIC. Without it SmolLM2 in bf16 gave three answers here ("...Rayleigh
    scattering, where light encounters", "...Rayleigh Scavenger,", "...Scavenger Hunt,"): a padded
    row's attention summed its keys otherwise than alone, and one row took oneDNN's one-row
    kernel. Uses the user's model cache (test_models). On CUDA (`make gpu-check`) the setting's
    levers are the CPU's: this reports whether the GPU keeps the promise without them."""
    import random

    from test_models import DEVICE, USER_CACHE
    from uniun_ray.models import DEFAULT_CHAT_MODEL, Engine
    from uniun_ray.models.requests.registry import CACHE_ENV

    from uniun_ray.models import materialize, resolve

    if USER_CACHE is None:
        monkeypatch.delenv(CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(CACHE_ENV, USER_CACHE)
    try:
        materialize(resolve(DEFAULT_CHAT_MODEL))
    except Exception as error:   # the lent GPU machine carries no embedded GGUF (../shared/gpu/README.md)
        pytest.skip(f"{DEFAULT_CHAT_MODEL} cannot be had here: {error}")
    engine = Engine(device=DEVICE, dtype=dtype, deterministic=True)
    engine.load(DEFAULT_CHAT_MODEL)
    rng, asked, questions = random.Random(1), 0, []
    batch = Batch(engine, slots=9)

    def ask(prompt: str, tokens: int):
        return batch.add(GenerateRequest(prompt=prompt, max_new_tokens=tokens, temperature=0), threading.Event())
    while asked < 20 or batch.busy:
        if asked < 20 and rng.random() < 0.3:
            questions.append(ask("In one sentence, why is the sky blue?", 14))
            asked += 1
        while asked < 20 and batch.rows + len(batch._waiting) < rng.randint(1, 8):
            ask(rng.choice(OTHERS), rng.randint(2, 20))
        if rng.random() < 0.05:
            engine.resident.prefix.clear()
        batch.step()
    answers = {engine.resident.vocabulary.tokenizer.decode(job.result.token_ids) for job in questions}
    assert len(answers) == 1, answers
