"""How long the one accelerator takes to do things, per model: the simulator's cost model.

A run of a job on the device is: an optional swap (unload + load of the wanted model),
a prefill over the prompt (plus, for a resumed job, the tokens it already produced: R6 is
recompute-style), which yields the first new token, then one decode step per further
token. A revoke takes effect at the next token boundary plus `revoke_delay_s` (the
StoppingCriteria sees the flag, generate returns, the actor answers the scheduler).

Where the numbers come from
---------------------------
``cpu`` (the default) is the 2-core development box this project is built on, with the
embedded models of the Makefile, as measured for issue 4: SmolLM2-135M decodes at about
45 tok/s and Gemma-3-270M at about 25 tok/s (transformers, batch 1, fp32); prefill runs at
about 10x the decode rate (one forward pass over many tokens instead of one per token);
a swap from the converted safetensors cache takes 1-3 s (the larger model is slower to
load). The revoke delay (20 ms) is an estimate: one StoppingCriteria check plus a Ray
reply, both well under a decode step.

``gpu`` is an estimate, not a measurement, for one datacenter GPU running the same
models with transformers in eager mode at batch 1. Decode of such small models is bound
by per-layer launch and Python overhead, roughly 0.4-0.5 ms per layer and token, so the
30-layer SmolLM2 (~15 ms/token) is slower than the 18-layer Gemma-3-270M (~10 ms/token);
prefill of a few thousand tokens costs tens of ms (0.02 ms/token); a swap is a load
from the page cache plus a host-to-device copy of <1 GB (0.4-0.6 s). Replace it with
measured numbers (the ModelActor times its loads) when a GPU run is available.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpeed:
    """Per-model costs, all in seconds."""

    decode_s: float            # one decode step (one output token after the first)
    prefill_s_per_token: float  # prefill cost per input token
    swap_s: float              # unload the current model and load this one

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    models: dict[str, ModelSpeed] = field(default_factory=dict)
    revoke_delay_s: float = 0.02

    def speed(self, model_id: str) -> ModelSpeed:
        try:
            return self.models[model_id]
        except KeyError:
            raise ValueError(f"device profile {self.name!r} has no speeds for model {model_id!r}; "
                             f"known: {', '.join(sorted(self.models))}") from None


#: Model ids used by the workloads. The active chat model is SMOLLM2.
SMOLLM2 = "smollm2-135m"
GEMMA3 = "gemma-3-270m"


def _from_rates(decode_tok_s: float, prefill_tok_s: float, swap_s: float) -> ModelSpeed:
    return ModelSpeed(1.0 / decode_tok_s, 1.0 / prefill_tok_s, swap_s)


PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", {
        SMOLLM2: _from_rates(45.0, 450.0, 1.2),
        GEMMA3: _from_rates(25.0, 250.0, 2.5),
    }),
    "gpu": DeviceProfile("gpu", {
        SMOLLM2: ModelSpeed(0.015, 0.00002, 0.4),
        GEMMA3: ModelSpeed(0.010, 0.00002, 0.6),
    }),
}
