"""Test support for slots (SPEC §6): a virtual-clock driver for devices with S slots each,
checking after every policy call, by scanning the snapshot and its own record of runs, what
R16 (per slot), R21, R22 and R23 say. It shares no code with the indexed policy it checks.
"""
from __future__ import annotations

from policy_support import Arrival, Run, t2_over_budget
from pool_support import PoolDriver
from uniun_ray.policy import Dispatch, PolicyConfig, Requeued, Revoke, RevokeCause, SchedulerPolicy

TIER = {"T0": 0, "T1": 1, "T2": 2, "T3": 3, "T4": 4}


def within(profile: dict[int, float] | None, chats: int, others: int, config: PolicyConfig) -> bool:
    """R23 read off a profile measured at every batch size 1..slots: may `others` other jobs
    decode beside `chats` chats? (None beside them always may.)"""
    if others == 0:
        return True
    if profile is None:
        return False
    bound = max(config.chat_step_slack * profile[chats], config.chat_step_floor_s)
    return profile[chats + others] <= bound * (1 + 1e-12)


class SlotDriver(PoolDriver):
    """Jobs take their `duration` whatever the batch (the policy's charge is the same: R24);
    a revoked job stops after `revoke_delay`; `tick` at `next_wakeup()`. The pool driver's
    clock, with `on` keyed by job (a device runs several)."""

    def __init__(self, config: PolicyConfig, devices: int, slots: int,
                 profile: dict[int, float] | None = None, revoke_delay: float = 0.05):
        self.names = tuple(f"d{i}" for i in range(devices))
        self.slots = slots
        self.profile = profile
        self.policy = SchedulerPolicy(config, devices=self.names, slots=slots)
        self.revoke_delay = revoke_delay
        self.now = 0.0
        self.durations: dict[str, float] = {}
        self.on: dict[str, tuple[Run, float]] = {}  # job id -> its run, when it ends
        self.loaded: dict[str, str | None] = dict.fromkeys(self.names)
        self.runs: list[Run] = []
        self.ended: dict[str, int] = {}
        self.samples: list[tuple[float, dict]] = []
        self.handed: set[str] = set()  # revoked jobs whose slot a Dispatch took (R22)
        self.models: set[str] = set()

    def _on_device(self, device: str) -> list[str]:
        return [j for j, (run, _) in self.on.items() if run.device == device]

    def _holding(self, device: str) -> list[str]:
        """The jobs holding a slot: with several slots a revoked job hands its slot to the next
        Dispatch at once (R22); with one it holds it until it ends."""
        return [j for j in self._on_device(device)
                if j not in self.handed and (self.slots == 1 or not self.on[j][0].revoked)]

    # -- checks --------------------------------------------------------------------------
    def _check_dispatch(self, d: Dispatch) -> None:
        here, holding = self._on_device(d.device), self._holding(d.device)
        assert len(holding) < self.slots, f"t={self.now}: {d.job_id} dispatched to full {d.device}"
        assert not d.swap or not here, f"t={self.now}: swap on {d.device} while {here} run"
        assert d.swap == (self.loaded[d.device] != d.model_id)
        assert d.slot not in {self.on[j][0].slot for j in holding}, f"t={self.now}: slot {d.slot} taken twice"
        for j in set(here) - set(holding) - self.handed:
            if self.on[j][0].slot == d.slot:  # the handover: the revoked run's slot-seconds end here (R24)
                self.handed.add(j)
                self.on[j][0].end = self.now
        unused = set(range(self.slots)) - {self.on[j][0].slot for j in here if j not in self.handed}
        assert d.slot in unused or d.slot in {self.on[j][0].slot for j in self.handed & set(here)}, \
            f"t={self.now}: {d.job_id} took slot {d.slot}, neither unused nor handed over"
        assert not unused or d.slot in unused, f"t={self.now}: {d.job_id} took a handed slot while {unused} were unused"

    def _check_state(self) -> None:
        """R16 per slot, R21 and R23 after the call's actions."""
        snap = self.policy.snapshot()
        queued = [j | {"tier": t} for t, jobs in snap["tiers"].items() for j in jobs]
        config = self.policy.config
        for dev in snap["devices"]:
            live = [j for j in dev["jobs"] if not j["revoked"]]
            holding = dev["jobs"] if self.slots == 1 else live
            chats = sum(j["kind"] == "chat" for j in live)
            assert len({j["model"] for j in dev["jobs"]}) <= 1, f"t={self.now}: two models on {dev['device']}"
            if chats:  # R23, with the revokes of this call counted as done
                assert within(self.profile, chats, len(live) - chats, config), \
                    f"t={self.now}: {dev['device']} runs {live} beside its chats"
            if len(holding) >= self.slots:
                continue
            if not dev["jobs"]:
                assert not queued, f"t={self.now}: {dev['device']} idles while {len(queued)} jobs wait"
                continue
            drain = next((j for j in queued if j["id"] == dev["draining_for"]), None)
            open_to = [j for j in queued if j["model"] == dev["loaded_model"]
                       and (drain is None or TIER[j["tier"]] < min(TIER[drain["tier"]], 2 + (not self._over())))
                       and (not chats or j["kind"] == "chat" or within(self.profile, chats, len(holding) - chats + 1,
                                                                        config))]
            assert not open_to, f"t={self.now}: a free slot on {dev['device']} while {open_to[0]['id']} waits"
        self.samples.append((self.now, snap))

    def _over(self) -> bool:
        """Whether the T2 budget may be over now (a draining device need not take T2 then)."""
        return t2_over_budget(self.runs, self.now, self.policy.config) is not False

    # -- driving -------------------------------------------------------------------------
    def call(self, method: str, *args) -> list:
        actions = getattr(self.policy, method)(*args)
        revokes = [a for a in actions if isinstance(a, Revoke)]
        if method == "submit":
            arrival = [r for r in revokes if r.cause is RevokeCause.ARRIVAL]
            devices = {self.on[r.job_id][0].device for r in arrival}
            assert len(devices) <= 1, f"t={self.now}: one arrival revoked jobs on {devices}"
        for r in revokes:
            run, end = self.on[r.job_id]
            assert not run.revoked, f"{r.job_id} revoked twice"
            run.revoked = True
            self.on[r.job_id] = (run, min(end, self.now + self.revoke_delay))
        for d in (a for a in actions if isinstance(a, Dispatch)):
            self._check_dispatch(d)
            job = next(j for dev in self.policy.snapshot()["devices"] for j in dev["jobs"] if j["id"] == d.job_id)
            run = Run(d.job_id, job["kind"], job["producer"], d.tier.label, self.now, device=d.device)
            run.slot = d.slot
            self.runs.append(run)
            self.on[d.job_id] = (run, self.now + self.durations[d.job_id])
            self.loaded[d.device] = d.model_id
        self._check_state()
        return actions

    def _finish(self, job_id: str) -> None:
        run, _ = self.on.pop(job_id)
        if job_id in self.handed:
            self.handed.discard(job_id)
        else:
            run.end = self.now
        outcome = "revoked" if run.revoked else "done"
        if Requeued(job_id) not in self.call("finish", job_id, self.now, outcome):
            self.ended[job_id] = self.ended.get(job_id, 0) + 1

    def run(self, arrivals: list[Arrival]) -> None:
        for a in arrivals:
            self.models.add(a.job.model_id)
        if self.profile is not None:
            for device in self.names:
                for model in self.models:
                    self.policy.set_step_profile(model, device, self.profile)
        PoolDriver.run(self, arrivals)  # the same clock: ends, arrivals, wake-ups
