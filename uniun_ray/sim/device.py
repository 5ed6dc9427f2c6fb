"""How long the one accelerator takes to do things, per model: the simulator's cost model.

A run of a job on the device is: an optional swap (unload + load of the wanted model),
a prefill over the part of the context (the prompt plus, for a resumed job, the tokens it
already produced, R6) that the prefix KV cache does not hold (`kvcache`), in chunks that
take `CHUNK_DECODE_STEPS` decode steps each as the engine sizes them (or of `prefill_chunk`
tokens when a profile fixes it), whose last chunk yields the first new token, then one decode
step per further token. A revoke takes effect at the next boundary — the end of the swap, of a
prefill chunk, or of a decode step, because the engine reads the cancel flag before every
forward pass — plus `revoke_delay_s` (the stopped generation reaches its holder, which
releases the lease, and the next job is granted). A revoke inside a chunk that is not the
last one stops with no new token; the chunks read stay in the KV cache for the resume (with
no cache, the resumed run reads the context again).

Several jobs on one device (slots, SPEC §6) decode together: one step gives each of b
decoding jobs a token and takes `ModelSpeed.step_s(b)`, the batch-1 decode step scaled by the
model's `batch_cost` curve (step(b) / step(1)), interpolated linearly between the measured
sizes and extrapolated from the last two past the largest (`uniun_ray.policy.steps.step_time`,
the function the policy's R23 uses on the same profile). How the simulator interleaves a
joining job's prefill with the others' steps is in `batch`.

Where the numbers come from
---------------------------
``cpu`` (the default) is the project's 2-core x86_64 development box with the embedded
models in bfloat16 (transformers, batch 1, 2 torch threads), as measured by
``benchmarks/engine_bench.py`` and ``benchmarks/runtime_bench.py`` on the earlier AVX-512
host (BENCHMARKS.md keeps the newest figures, on other hosts; these are in its history and in
that of the engine's `uniun_ray/models/MEASURED.md`, now folded into it):

* decode: SmolLM2-135M-Instruct 22.33 tok/s, Gemma-3-270M 19.48 tok/s;
* prefill: 1107 tokens in 1.61 s (SmolLM2, 688 tok/s) and 1078 in 1.14 s (Gemma, 946 tok/s;
  Gemma keeps only the last position's logits, and its 18 layers are fewer than SmolLM2's
  30), in 256-token chunks. Per-token cost is flat from ~150 to ~1000
  tokens on this machine, so prefill is modelled as linear in the context length;
* swap: `ModelActor.load` of a model while another is resident, p50 over 5: SmolLM2
  0.43 s, Gemma 3.29 s (its 33 MB tokenizer), `tiny` 0.47 s;
* revoke delay, 10 ms: the revoke-to-stop latency is 17 ms p50 *including* the wait for
  the forward pass under way, and after the stop the holder's release,
  the next grant and its first model call are a few actor calls at 1-3 ms each (the
  control plane cost 7 ms p50 per job then).

The machine is shared, so these are typical, not guaranteed: under load every figure
stretches (the real runtime beside the simulator: BENCHMARKS.md, "Simulator").

``gpu`` is an estimate, not a measurement, for one datacenter GPU running the same
models with transformers in eager mode at batch 1. Decode of such small models is bound
by per-layer launch and Python overhead, roughly 0.4-0.5 ms per layer and token, so the
30-layer SmolLM2 (~15 ms/token) is slower than the 18-layer Gemma-3-270M (~10 ms/token);
prefill of a few thousand tokens costs tens of ms (0.02 ms/token); a swap is a load
from the page cache plus a host-to-device copy of <1 GB (0.4-0.6 s). Replace it with
measured numbers (the ModelActor times its loads) when a GPU run is available.

Batches (SPEC §6): step(b) / step(1), per profile
--------------------------------------------------
``cpu``: SmolLM2-135M-Instruct measured by ``benchmarks/step_profile.py --threads 1 --clock cpu
--steps 8 --repeats 5`` on 2026-12-03 08:57 UTC, on this turn's host (x86_64 "Intel(R) Xeon(R)
Processor", 2 cores, torch 2.13.0+cpu, AVX-512), float32, 256-token prompts, in CPU seconds
because the machine ran other sessions' work beside it (load average 8-12): 60.2, 71.2, 109.8,
155.2, 197.4, 292.7 ms per step at batch 1, 2, 4, 8, 16, 32, i.e. 1.0, 1.7, 2.2, 3.1, 4.9, 6.6x
the tokens per second of one sequence (`docs/bench/step-profile-smollm2-135m-instruct-cpu.json`;
a run an hour earlier under heavier load gave 1.0, 1.7, 2.0, 3.1, 3.9, 6.4x: the figures move by
a fifth). PROVISIONAL: one thread, not both cores, and not a quiet machine; rerun the probe
alone (both cores, wall clock) and replace the curve. Only its shape is used: the batch-1 step
stays the profile's 22.33 tok/s above, so that one slot's tables do not move, and every cpu
model takes SmolLM2's curve (Gemma and tiny are not measured). R23 then keeps two jobs beside a
SmolLM2 chat: its bound is the floor, 75 ms (1.25 x 44.8 ms is less), which step(3) = 67 ms meets
and step(4) = 82 ms does not; one beside a Gemma chat (51 ms alone: step(2) = 61 ms, step(3) = 77 ms).

``gpu``: an estimate from published figures, not a measurement. vLLM serving Qwen2.5-0.5B on
one datacenter GPU decodes ~65 tok/s for one sequence and ~1,737 tok/s for 128 (the figures
the slot study quotes; the page they come from is not among this project's references), so a step
of 128 sequences takes (128 / 1737) / (1 / 65) = 4.79 steps of one: the weights are read once
per step whatever the batch, and each sequence adds its attention and its share of the
matrix products. The curve is linear between the two points (and past 128, as the policy
extrapolates): 1 + 0.0298 (b - 1), i.e. 11x the tokens per second of one sequence at 16, 17x
at 32; R23 then keeps every other slot beside one chat: a 15 ms step alone is bound by the 75 ms
floor, which steps meet up to about 135 rows (1.25 x its step alone, up to 9 rows). Other public
reports have the same shape: vLLM issue #5567 (55 tok/s at batch 1, 1,275 at 256: 23x) and
GPULlama3.java PR #129 (41x aggregate for Llama-3.2-1B in fp16 on an RTX 4090, large B). The
batch-1 step stays the estimate above (15 ms SmolLM2, 10 ms Gemma): a transformers engine in
eager mode, slower per step than vLLM's 65 tok/s, gains the same factor from batching only if
its per-step overhead is shared as vLLM's is; replace both with a `benchmarks/step_profile.py`
run on a GPU when one is lent.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from ..events.schema import COLD, SWITCH, WARM
from ..policy.steps import step_time

#: A prefill chunk takes this many decode steps, as the engine sizes them
#: (`uniun_ray.models.tune.tuning.CHUNK_DECODE_STEPS`; the simulator does not import the models).
CHUNK_DECODE_STEPS = 2.0


@dataclass(frozen=True)
class ModelSpeed:
    """Per-model costs, all in seconds. `batch_cost` is the step time at each measured batch
    size relative to batch 1, as (batch, factor) pairs; the default, batch 1 alone, means no
    gain from batching (b jobs step in b times one job's step)."""

    decode_s: float            # one decode step of one job (one output token after the first)
    prefill_s_per_token: float  # prefill cost per context token
    swap_s: float              # unload the current model and load this one (a cold load)
    batch_cost: tuple[tuple[int, float], ...] = ((1, 1.0),)
    warm_s: float | None = None     # a swap back from host memory (None: as cold)
    switch_s: float | None = None   # a switch to it, resident beside the last model (None: as warm)
    #: The slots the runtime's "auto" (R25, `models.runner.profile.auto_slots` over `steps` at the
    #: batch sizes it measures) gives the model once loaded: 1 for a model its engine cannot
    #: batch (Gemma's sliding window). Played where the simulator is given ``slots="auto"``.
    auto_slots: int = 1

    def swap_cost(self, kind: str) -> float:
        """Seconds of a swap to this model of `kind` (``events.schema.SWAP_KINDS``)."""
        warm = self.swap_s if self.warm_s is None else self.warm_s
        return {COLD: self.swap_s, WARM: warm, SWITCH: warm if self.switch_s is None else self.switch_s}[kind]

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    @cached_property
    def steps(self) -> dict[int, float]:
        """Seconds per decode step at each measured batch size: what the policy is given (R23)."""
        return {batch: self.decode_s * factor for batch, factor in self.batch_cost}

    def step_s(self, batch: int) -> float:
        """Seconds per decode step of `batch` jobs together (exactly `decode_s` for one)."""
        return self.decode_s if batch == 1 else step_time(self.steps, batch)

    @cached_property
    def fixed_s(self) -> float:
        """The part of a step that does not grow with the batch (the weights read once per
        forward pass, the kernels launched): the step curve's intercept, 2 step(1) - step(2).
        0 without a batching gain."""
        return max(0.0, 2 * self.step_s(1) - self.step_s(2))


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    models: dict[str, ModelSpeed] = field(default_factory=dict)
    revoke_delay_s: float = 0.01
    prefill_chunk: int | None = None  # tokens per prefill pass, fixed; None: sized by time
    #: The prefix KV cache per device, in tokens (0: none). The runtime's default budget
    #: (UNIUN_KV_CACHE_MB=1024) holds about 22k tokens of SmolLM2 in float32.
    kv_cache_tokens: int = 20_000
    #: Where the models' batch curves come from, in a few words, for the figures that use them.
    batch_source: str = ""
    #: How a model that was on a device comes back: COLD (nothing is kept: every swap
    #: loads), WARM (kept in host memory) or SWITCH (kept on the device). The warm budget is not
    #: modelled: the host keeps every model it has loaded.
    keeps: str = COLD

    def chunk_tokens(self, speed: ModelSpeed) -> int:
        """Tokens per prefill pass: fixed, or as many as fit in CHUNK_DECODE_STEPS decode steps."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return max(1, int(CHUNK_DECODE_STEPS * speed.decode_s / speed.prefill_s_per_token))

    def speed(self, model_id: str) -> ModelSpeed:
        try:
            return self.models[model_id]
        except KeyError:
            raise ValueError(f"device profile {self.name!r} has no speeds for model {model_id!r}; "
                             f"known: {', '.join(sorted(self.models))}") from None


#: Model ids used by the workloads, as the registry names them (so a real run's event log
#: and the profile agree). The active chat model is SMOLLM2.
SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma-3-270m"
TINY = "tiny"


#: Step time per batch size relative to batch 1 on the CPU: SmolLM2 measured beside other work,
#: provisional (see "Batches" above).
CPU_BATCH_COST = ((1, 1.0), (2, 1.181), (4, 1.822), (8, 2.575), (16, 3.277), (32, 4.858))  # provisional
#: The same on one datacenter GPU, an estimate from published figures (see above): vLLM,
#: Qwen2.5-0.5B, 65 tok/s at one sequence and 1,737 at 128.
GPU_BATCH_COST = ((1, 1.0), (128, (128 / 1737) / (1 / 65)))


def _from_rates(decode_tok_s: float, prefill_tok_s: float, swap_s: float, auto_slots: int) -> ModelSpeed:
    return ModelSpeed(1.0 / decode_tok_s, 1.0 / prefill_tok_s, swap_s, CPU_BATCH_COST, auto_slots=auto_slots)


#: What "auto" chooses on these curves (checked against `auto_slots` in tests/test_sim_swaps.py):
#: 16 of the CPU's sizes 1-16 (tokens per second still grow past 8), 64 of a GPU's 1-64.
CPU_AUTO_SLOTS, GPU_AUTO_SLOTS = 16, 64

PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", {
        SMOLLM2: _from_rates(22.33, 1107 / 1.61, 0.43, CPU_AUTO_SLOTS),
        GEMMA3: _from_rates(19.48, 1078 / 1.14, 3.29, 1),
        TINY: _from_rates(834.55, 1188 / 0.03, 0.47, CPU_AUTO_SLOTS),
    }, batch_source="SmolLM2's batch curve measured beside other work, one thread, CPU seconds: provisional"),
    "gpu": DeviceProfile("gpu", {
        SMOLLM2: ModelSpeed(0.015, 0.00002, 0.4, GPU_BATCH_COST, auto_slots=GPU_AUTO_SLOTS),
        GEMMA3: ModelSpeed(0.010, 0.00002, 0.6, GPU_BATCH_COST),
    }, batch_source="batch curve estimated from published vLLM figures, not measured"),
}

#: Seconds of `ModelActor.load` switching back to a model kept co-resident on this
#: CPU (the runtime's default since then), SmolLM2 <-> Gemma back and forth
#: (``benchmarks/runtime_bench.py --swaps-only --quick``: p50 of 2, 1.3 and 1.4 ms). PROVISIONAL:
#: measured beside other sessions' work; `tiny` is not measured and takes SmolLM2's.
CPU_SWITCH_S = {SMOLLM2: 0.0013, GEMMA3: 0.0014, TINY: 0.0013}
#: The `cpu` profile as the runtime now runs it: a model that was on the device comes back
#: as a switch (``keeps``); its first load is the same cold load.
PROFILES["cpu-warm"] = replace(PROFILES["cpu"], name="cpu-warm", keeps=SWITCH, models={
    model: replace(speed, switch_s=CPU_SWITCH_S[model]) for model, speed in PROFILES["cpu"].models.items()})
