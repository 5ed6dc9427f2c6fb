"""What a swap was: its kind and its measured time, as an engine's ``load`` reports it.

The scheduler weighs a swap by its cost (SPEC R12), and the cost depends on where the model
was: on the device already beside the active one (a switch: no copy), in host memory (a warm
copy back at the bus's speed), or nowhere (a cold load: the files read, the weights converted,
the host probed). Torch-free: the runtime's driver and the policy's shell read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..events.schema import COLD, SWAP_KINDS, SWITCH, WARM  # the event log's words for them

#: The model was resident already: nothing happened. Else COLD (read from its files,
#: ``from_pretrained``, tuned and packed), WARM (copied back from host memory: pinned on a GPU;
#: on a CPU the weights never left it) or SWITCH (already on the device beside the active
#: model: only the active model changed).
NONE = "none"
KINDS = (NONE, *SWAP_KINDS)

#: Where an idle model is kept (``Swap.kept``): the kind its swap back will be.
RESIDENT = "resident"   # on the device, beside the active model: a switch
HOST = "host"           # in host memory: a warm copy


class SwapAbandoned(RuntimeError):
    """A load given up before it ended (its ``abandon`` flag was set): a chat needs the device
    for another model (R13). The engine then holds no active model; the one it replaced stays
    warm."""


@dataclass(frozen=True)
class Swap:
    """One ``load``: the model made active, how (``kind``), in how many seconds (the swap's
    whole cost: the old model set aside and the new one ready), the model it replaced, the
    idle models kept afterwards (model id -> RESIDENT or HOST), the bytes each counts for where
    the engine knows them (``kept_bytes``: the size of a warm copy back, which the scheduler
    prices a first copy by) and, when a warm swap fell back to a cold load, why (``note``)."""

    model: str
    kind: str
    seconds: float
    previous: str | None = None
    kept: dict[str, str] = field(default_factory=dict)
    note: str = ""
    kept_bytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"swap kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def next_kind(self, model_id: str) -> str:
        """The kind a swap to ``model_id`` would be after this one."""
        if model_id == self.model:
            return NONE
        return {RESIDENT: SWITCH, HOST: WARM}.get(self.kept.get(model_id), COLD)

    def describe(self) -> dict:
        return {"model": self.model, "kind": self.kind, "seconds": self.seconds, "from": self.previous,
                "kept": dict(self.kept)} | ({"note": self.note} if self.note else {})
