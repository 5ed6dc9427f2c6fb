"""The event log: one schema for a simulated run and a real one.

The metrics and the pictures read only this log, so a JSONL file that the runtime writes
in this shape is scored and drawn by the same code as a simulation (the file: `log`). One event per line,
a JSON object; events are in time order (ties keep the order they happened in).

Every event has ``t`` (seconds, float, any origin but one clock for the whole log) and
``ev`` (its type). Job events also carry ``job`` (the id), and repeat the job's
``kind``, ``producer`` and ``model`` so that a line reads on its own; readers take those
from the job's ``submit``. The events of a run (dispatch, swap_start, swap_end,
first_token, revoke, finish) carry ``device``, the device it runs on (SPEC §5); a log
whose runs carry none is of one device, which readers call "dev0".

=============  ==========================================================================
``ev``         further fields
=============  ==========================================================================
submit         job, kind ("chat"|"nataraj"|"gana"|"extract"), producer, model,
               deadline (float|null, same clock as t), foreground_hint (bool),
               subject (str|null); optional: prompt_tokens, output_tokens (ints)
foreground     kind (str|null: nothing in front), subject (str|null)
dispatch       job, kind, producer, model, swap (bool); optional: tier (0-4, the job's
               tier at dispatch; readers derive it from R1 when absent), slot (int, the
               device's slot it takes, SPEC §6; 0 when absent), batch (int, the jobs
               dispatched to the device and not finished, this one included; 1 when absent)
swap_start     job, kind, producer, model (being loaded), from (model unloaded, or null)
swap_end       job, kind, producer, model; optional: seconds (float, the swap's measured
               time), swap_kind ("cold"|"warm"|"switch": a load from the files, a copy
               back from host memory, a switch to a model resident beside the last one;
               "cold" when absent), abandoned (true: the load was given up for a chat on
               another model, R13, and the device holds no active model)
first_token    job, kind, producer, model: the job's first generated token (once per job;
               a resumed job does not emit it again)
revoke         job, kind, producer, model: the scheduler revoked the running job; optional:
               cause (the policy's RevokeCause: "arrival"|"foreground"|"deadline"|
               "affinity"|"step"|"cancel"|"reclaim"), batch (int, the jobs on the device
               when it was revoked, this one included; 1 when absent); with cause "step"
               (R23): chats (int), bound_s (float: the step beside them may take), step_profile
               ({batch: seconds per step} the policy read)
finish         job, kind, producer, model, outcome ("done"|"failed"|"revoked"),
               tokens (int, tokens produced so far, optional), requeued (bool, optional:
               the policy put the job back in its queue, R6; it is dispatched later).
               Without ``requeued``, after "revoked" a chat job is over (it failed as
               preempted) and any other kind is queued again.
reclaim        job, kind, producer, model, reason: the runtime took a lease back from a
               holder that stopped renewing it (it died); a finish "revoked" follows
drop           job, kind, producer, model, reason: a queued job ended without running
               (its caller cancelled it or stopped polling for its grant)
device         device, change ("added"|"removed"); optional: reason. The pool changed
               (SPEC §5, R20): a device joined it, or left it for good; the job it ran,
               if any, finishes "failed" with ``requeued`` and runs elsewhere
slots          device, model, slots (int): after loading ``model`` the device decodes up to
               ``slots`` jobs together (SPEC §6, R25); optional: step_profile ({batch: seconds
               per step}, R23), auto (bool: the count was measured, not set)
fault          where (the scheduler's step that failed, e.g. "prepare"), error (its type and
               message): a fault of the scheduler's own code, logged with its traceback; optional:
               job, kind, producer, model, device (the run it failed; a finish "failed" follows
               while the job was still running)
node           node (Ray's node id), address, change ("joined"|"left"); optional: reason.
               A node of the cluster joined it (its devices follow as ``device`` "added")
               or died (its devices leave as ``device`` "removed")
=============  ==========================================================================

``revoke`` may carry ``reason``, the runtime's words for its ``cause`` ("arrival of chat job
c-1"); the runtime writes both, the simulator the cause alone.

A job holds its slot of the device from its ``dispatch`` to its ``finish`` (swap included),
which is the time R7 charges to its flow (slot-seconds, R24: the same whatever the batch).
"""
from __future__ import annotations

from typing import Iterable

Event = dict

JOB_FIELDS = ("job", "kind", "producer", "model")
#: A swap's kinds (``swap_end``'s ``swap_kind``): read from the files; copied back from host
#: memory; switched to on the device, where it stayed beside the model it replaced.
COLD, WARM, SWITCH = "cold", "warm", "switch"
SWAP_KINDS = (COLD, WARM, SWITCH)
REQUIRED: dict[str, tuple[str, ...]] = {
    "submit": JOB_FIELDS + ("deadline", "foreground_hint", "subject"),
    "foreground": ("kind", "subject"),
    "dispatch": JOB_FIELDS + ("swap",),
    "swap_start": JOB_FIELDS + ("from",),
    "swap_end": JOB_FIELDS,
    "first_token": JOB_FIELDS,
    "revoke": JOB_FIELDS,
    "finish": JOB_FIELDS + ("outcome",),
    "reclaim": JOB_FIELDS + ("reason",),
    "drop": JOB_FIELDS + ("reason",),
    "device": ("device", "change"),
    "node": ("node", "address", "change"),
    "slots": ("device", "model", "slots"),
    "fault": ("where", "error"),
}
OUTCOMES = ("done", "failed", "revoked")


def validate(events: Iterable[Event]) -> None:
    """Raise ValueError at the first event that breaks the schema (a runtime's self-check)."""
    last = float("-inf")
    for i, ev in enumerate(events):
        kind = ev.get("ev")
        if kind not in REQUIRED:
            raise ValueError(f"event {i}: unknown type {kind!r}")
        missing = [f for f in ("t",) + REQUIRED[kind] if f not in ev]
        if missing:
            raise ValueError(f"event {i} ({kind}): missing {', '.join(missing)}")
        if ev["t"] < last:
            raise ValueError(f"event {i} ({kind}): time {ev['t']} is before the previous {last}")
        if kind == "finish" and ev["outcome"] not in OUTCOMES:
            raise ValueError(f"event {i}: outcome {ev['outcome']!r} is not one of {OUTCOMES}")
        last = ev["t"]
