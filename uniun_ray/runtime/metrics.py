"""Ray metrics for the dashboard and Prometheus, all named `uniun_*` (Ray exports them as
`ray_uniun_*` on each node's metrics port; `observability/grafana_uniun.json` charts them).
What happens on a device of the pool (dispatches, swaps, revokes, what it holds and runs)
carries a `device` tag (SPEC §5).

Why fed from the event log: the scheduler already writes every decision as an event, so
counters and histograms are derived from exactly what `explain` and the timeline read, and
cannot disagree with them. Gauges (queue depth, running job, vruntimes, T2 share) describe
state, not decisions, so they are refreshed from the policy's snapshot by the scheduler's
timer, at most once per `period_s` (a snapshot sorts the queue; a burst of submits must
not pay for one each).

The model actor and the embedder observe what only they can time (revoke-to-stop, embed
latency) with the metrics defined here too, so every name and bucket lives in one place.
"""
from __future__ import annotations

import time
from typing import Callable

from ray.util.metrics import Counter, Gauge, Histogram

from ..policy import Kind, Tier

#: Bucket edges (seconds). Waits and TTFT span an idle chat (tens of ms) to a starved job
#: (minutes); swaps and stops are narrower.
WAIT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]
SWAP_BUCKETS = [0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60]
STOP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]
EMBED_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]

KINDS = tuple(k.value for k in Kind)
TIERS = tuple(t.label for t in Tier)


class SchedulerMetrics:
    """The scheduler's sink: `write(event)` for each event it emits, `refresh(snapshot)`
    from its timer."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self._refreshed = float("-inf")
        self._queued_since: dict[str, float] = {}  # job -> queued since (submit, or a re-queue)
        self._submitted: dict[str, float] = {}     # job -> submit time, until it ends
        self._loaded: set[tuple[str, str]] = set()   # (model, device) ever seen loaded
        self._devices: set[str] = set()
        kind, model, tier, device = ("kind",), ("model",), ("tier",), ("device",)
        self.submits = Counter("uniun_submits_total", "Jobs submitted", kind)
        self.dispatches = Counter("uniun_dispatches_total", "Jobs given a device (tier at dispatch)",
                                  kind + tier + model + device)
        self.revokes = Counter("uniun_revokes_total", "Running jobs revoked, by what caused it",
                               kind + ("cause",) + device)
        self.swaps = Counter("uniun_swaps_total", "Model loads (swaps), by the model loaded and the swap's kind "
                             "(cold load, warm copy, switch)", model + device + ("swap_kind",))
        self.reclaims = Counter("uniun_reclaims_total", "Leases taken back from a holder that stopped renewing", kind)
        self.drops = Counter("uniun_drops_total", "Queued jobs ended without running (cancelled, caller gone)", kind)
        self.finishes = Counter("uniun_finishes_total", "Runs ended, by outcome", kind + ("outcome",))
        self.wait = Histogram("uniun_wait_seconds", "Queued time before a dispatch: from submit, or from a "
                              "revoked run's end, to the dispatch (tier at dispatch)", WAIT_BUCKETS, kind + tier)
        self.ttft = Histogram("uniun_ttft_seconds", "Submit to first token", WAIT_BUCKETS, kind + model)
        self.swap_s = Histogram("uniun_swap_seconds", "Model load time, by the swap's kind", SWAP_BUCKETS,
                                model + device + ("swap_kind",))
        self.depth = Gauge("uniun_queue_depth", "Jobs queued, by their current tier", tier)
        self.oldest = Gauge("uniun_queue_oldest_wait_seconds", "Longest wait among a tier's queued jobs", tier)
        self.running = Gauge("uniun_running", "Jobs of the kind in the device's slots", kind + device)
        self.slots = Gauge("uniun_slots", "Jobs the device may decode together (slots, R25)", device)
        self.slots_busy = Gauge("uniun_slots_busy", "Slots of the device holding a job", device)
        self.running_tier = Gauge("uniun_running_tier", "Tier of the job in the device's first slot (-1: idle)",
                                  device)
        self.held = Gauge("uniun_running_held_seconds", "How long the job in the device's first slot has held it",
                          device)
        self.loaded = Gauge("uniun_loaded_model", "1 for the model resident on the device", model + device)
        self.foreground = Gauge("uniun_foreground", "1 for the kind in front (T1)", kind)
        self.vruntime = Gauge("uniun_vruntime", "Fair-pool vruntime per flow (level: kind or producer)",
                              ("level", "flow"))
        self.t2_share = Gauge("uniun_t2_share", "T2 (extract) share of held time over the sliding window")
        self.t2_limit = Gauge("uniun_t2_share_limit", "The T2 share limit (R11)")

    # -- decisions ----------------------------------------------------------------------
    def write(self, event: dict) -> None:
        ev, job, t = event["ev"], event.get("job"), event["t"]
        if ev == "submit":
            self.submits.inc(tags={"kind": event["kind"]})
            self._submitted[job] = t
            self._queued_since[job] = t
        elif ev == "dispatch":
            tier = f"T{event['tier']}"
            self.dispatches.inc(tags={"kind": event["kind"], "tier": tier, "model": event["model"],
                                      "device": _device(event)})
            since = self._queued_since.pop(job, None)
            if since is not None:
                self.wait.observe(t - since, tags={"kind": event["kind"], "tier": tier})
        elif ev == "swap_end" and not event.get("abandoned"):   # a load given up loaded nothing
            tags = {"model": event["model"], "device": _device(event), "swap_kind": event.get("swap_kind", "cold")}
            self.swaps.inc(tags=tags)
            self.swap_s.observe(event["seconds"], tags=tags)
        elif ev == "first_token" and job in self._submitted:
            self.ttft.observe(t - self._submitted[job], tags={"kind": event["kind"], "model": event["model"]})
        elif ev == "revoke":
            self.revokes.inc(tags={"kind": event["kind"], "cause": event.get("cause", "unknown"),
                                   "device": _device(event)})
        elif ev == "reclaim":
            self.reclaims.inc(tags={"kind": event["kind"]})
        elif ev == "drop":
            self.drops.inc(tags={"kind": event["kind"]})
            self._forget(job)
        elif ev == "finish":
            self.finishes.inc(tags={"kind": event["kind"], "outcome": event["outcome"]})
            if event.get("requeued"):  # the policy's word (its Requeued action)
                self._queued_since[job] = t  # re-queued (R6); pruned by refresh if not
            else:
                self._forget(job)

    def _forget(self, job: str) -> None:
        self._submitted.pop(job, None)
        self._queued_since.pop(job, None)

    # -- state ---------------------------------------------------------------------------
    def refresh(self, snapshot: Callable[[], dict], now: float | None = None) -> None:
        """Set the gauges from `snapshot()`, unless the last refresh is under `period_s` old."""
        now = time.monotonic() if now is None else now
        if now - self._refreshed < self.period_s:
            return
        self._refreshed = now
        snap = snapshot()
        present = set()
        for tier in TIERS:
            queued = snap["tiers"].get(tier, [])
            present.update(job["id"] for job in queued)
            self.depth.set(len(queued), tags={"tier": tier})
            self.oldest.set(max((job["waited_s"] for job in queued), default=0.0), tags={"tier": tier})
        for kind in KINDS:
            self.foreground.set(int(snap["foreground"]["kind"] == kind), tags={"kind": kind})
        loaded = {(d["loaded_model"], d["device"]) for d in snap["devices"] if d["loaded_model"]}
        self._loaded |= loaded
        for model, device in self._loaded:   # a model swapped out (or a device gone) reads 0
            self.loaded.set(int((model, device) in loaded), tags={"model": model, "device": device})
        devices = {d["device"]: d for d in snap["devices"]}
        self._devices |= set(devices)
        for device in self._devices:
            jobs = devices[device]["jobs"] if device in devices else []
            job = jobs[0] if jobs else None       # the first slot's: what tier and held time show
            present.update(j["id"] for j in jobs)
            for kind in KINDS:
                self.running.set(sum(j["kind"] == kind for j in jobs), tags={"kind": kind, "device": device})
            self.running_tier.set(int(job["tier"][1:]) if job else -1, tags={"device": device})
            self.held.set(job["held_s"] if job else 0.0, tags={"device": device})
            self.slots.set(devices[device]["slots"] if device in devices else 0, tags={"device": device})
            self.slots_busy.set(len(jobs), tags={"device": device})
        for kind, value in snap["vruntime"]["kinds"].items():
            self.vruntime.set(value, tags={"level": "kind", "flow": kind})
        for flows in snap["vruntime"]["producers"].values():
            for flow, value in flows.items():
                self.vruntime.set(value, tags={"level": "producer", "flow": flow})
        self.t2_share.set(snap["t2"]["share"])
        self.t2_limit.set(snap["t2"]["limit"])
        # a revoked job that was not re-queued (cancelled while running) ended unseen here
        for job in set(self._submitted) - present:
            self._forget(job)


def _device(event: dict) -> str:
    """A run's device; a log of one device may name none (events.schema)."""
    return event.get("device", "dev0")


class ModelMetrics:
    """What the ModelActor times (from a revoke to the generation actually stopping) and how its
    prefix KV cache does (refreshed after every generation)."""

    def __init__(self) -> None:
        self.stop = Histogram("uniun_revoke_stop_seconds", "Revoke to the generation stopping (token boundary)",
                              STOP_BUCKETS, ("model",))
        model = ("model",)
        self.kv = {
            "held_bytes": Gauge("uniun_kv_cache_held_bytes", "Bytes of KV the prefix cache holds in device memory",
                                model),
            "offloaded_bytes": Gauge("uniun_kv_cache_offloaded_bytes",
                                     "Bytes of KV the prefix cache moved to CPU memory (0 on a CPU device)", model),
            "hit_rate": Gauge("uniun_kv_cache_hit_rate", "Share of generations that reused a cached prefix", model),
            "reused_tokens": Gauge("uniun_kv_cache_reused_tokens",
                                   "Prompt tokens taken from the prefix cache, not prefilled (since load)", model),
            "prefilled_tokens": Gauge("uniun_kv_cache_prefilled_tokens", "Prompt tokens prefilled (since load)", model),
            "offloads": Gauge("uniun_kv_cache_offloads",
                              "Entries moved to CPU memory to stay within UNIUN_KV_CACHE_MB (since load)", model),
            "restores": Gauge("uniun_kv_cache_restores",
                              "Hits on entries in CPU memory, moved back to the device (since load)", model),
            "evictions": Gauge("uniun_kv_cache_evictions", "Prefix cache entries dropped to stay within "
                               "UNIUN_KV_CACHE_MB and UNIUN_KV_OFFLOAD_MB (since load)", model),
        }

    def kv_cache(self, model: str | None, described: dict) -> None:
        tags = {"model": str(model)}
        self.kv["held_bytes"].set(described["held_mb"] * 2**20, tags=tags)
        self.kv["offloaded_bytes"].set(described["offloaded_mb"] * 2**20, tags=tags)
        self.kv["hit_rate"].set(described["hit_rate"] or 0.0, tags=tags)
        for name in ("reused_tokens", "prefilled_tokens", "offloads", "restores", "evictions"):
            self.kv[name].set(described[name], tags=tags)


class EmbedderMetrics:
    """What the EmbeddingActor times: per-call latency, calls in flight, texts embedded."""

    def __init__(self) -> None:
        self.latency = Histogram("uniun_embed_seconds", "Embedding call latency", EMBED_BUCKETS)
        self.in_flight = Gauge("uniun_embed_in_flight", "Embedding calls running now (max_concurrency 2)")
        self.texts = Counter("uniun_embed_texts_total", "Texts embedded")
