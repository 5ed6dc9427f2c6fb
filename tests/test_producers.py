"""Producer actors on the `tiny` model against a real local Ray (the `runtime` fixture):
Nataraj keeps its deck filled, a Gana cron run carries its fire time and its own model,
opening a note hoists its extraction, and a page only clears the foreground it owns.

To look at queued jobs, the device is held by a chat `run` (T0, never preempted) while the
producers submit; their jobs then sit in the scheduler's tiers where `status()` shows them."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

import uniun_ray
from uniun_ray.producers import producer_name, spawn_producer

pytestmark = pytest.mark.ray


def wait_for(predicate, timeout_s: float = 30.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {predicate}")


def queued(tier: str, **match) -> dict | None:
    """The first job queued in `tier` whose fields match."""
    for job in uniun_ray.status()["tiers"][tier]:
        if all(job.get(k) == v for k, v in match.items()):
            return job
    return None


@contextmanager
def device_held(model_id: str = "tiny"):
    """Hold the device with a chat job until the block ends."""
    held, release = threading.Event(), threading.Event()

    def work(lease):
        held.set()
        release.wait(30)

    thread = threading.Thread(target=uniun_ray.run, args=("chat", model_id, work), daemon=True)
    thread.start()
    assert held.wait(60), "the chat job never got the device"
    try:
        yield
    finally:
        release.set()
        thread.join(30)


@pytest.fixture
def producers(ray_cluster):
    """Spawn producers; kill them at the end (the runtime fixture only kills its own)."""
    spawned = []

    def spawn(kind, producer_id, **options):
        spawned.append(spawn_producer(kind, producer_id, **options))
        return spawned[-1]
    yield spawn
    for handle in spawned:
        ray_cluster.kill(handle, no_restart=True)


def test_spawn_checks_kind_and_options_in_the_caller():
    with pytest.raises(ValueError, match="unknown kind 'poem'.*chat, nataraj, gana, extract"):
        spawn_producer("poem", "x")
    with pytest.raises(ValueError, match="NatarajProducer: .*deck"):
        spawn_producer("nataraj", "x", deck=3)
    assert producer_name("gana", "42") == "producer:gana:42"


@pytest.mark.slow
def test_nataraj_keeps_its_deck_full(runtime, producers, ray_cluster):
    deck = producers("nataraj", "deck", deck_size=3, model_id="tiny", max_new_tokens=4)
    assert ray_cluster.get(deck.wait_deck.remote(timeout_s=60)) == 3
    card = ray_cluster.get(deck.take_card.remote())
    assert card["text"] and card["job_id"].startswith("nataraj-")
    assert ray_cluster.get(deck.wait_deck.remote(timeout_s=30)) == 3      # refilled
    state = ray_cluster.get(deck.state.remote())
    assert (state["done"], state["taken"], state["in_flight"], state["deck"]) == (4, 1, 0, "3/3")
    assert ray_cluster.get_actor("producer:nataraj:deck", namespace="uniun")  # named for the dashboard
    # every card was charged to the producer's own flow (R8)
    assert uniun_ray.status()["vruntime"]["producers"]["nataraj"]["nataraj:deck"] > 0
    # the page puts nataraj in front while it is open
    ray_cluster.get(deck.open_page.remote())
    assert uniun_ray.status()["foreground"] == {"kind": "nataraj", "subject": None}
    ray_cluster.get(deck.close_page.remote())
    assert uniun_ray.status()["foreground"] == {"kind": None, "subject": None}
    # stop withdraws the refill waiting for the device: nothing of it is left at the scheduler
    with device_held():
        ray_cluster.get(deck.take_card.remote())
        wait_for(lambda: queued("T4", producer="nataraj:deck"), 10)
        ray_cluster.get(deck.stop.remote())
        assert uniun_ray.status()["queued"] == 0
        assert ray_cluster.get(deck.state.remote())["in_flight"] == 0


@pytest.mark.slow
def test_gana_cron_run_carries_its_fire_time_and_model(runtime, producers, ray_cluster):
    gana = producers("gana", "g1", desired_model_id="tiny", max_new_tokens=4)
    now = ray_cluster.get(gana.fire.remote("Rain:"), timeout=60)          # due at once; warms up
    assert "error" not in now, now
    assert (now["model_id"], now["late_s"] > 0) == ("tiny", True)
    with device_held():
        fire_at = time.time() + 1.5
        ref = gana.fire.remote("Rain:", fire_at)
        job = wait_for(lambda: queued("T4", producer="gana:g1"), 1.4)     # not due yet: fair pool
        assert (job["deadline"], job["model"], job["subject"]) == (pytest.approx(fire_at), "tiny", None)
        wait_for(lambda: queued("T3", producer="gana:g1"), fire_at - time.time() + 1)  # due: EDF
        assert uniun_ray.status()["foreground"]["kind"] is None            # cron never sets it
    record = ray_cluster.get(ref, timeout=30)
    assert "error" not in record, record
    assert (record["deadline"], record["model_id"], record["job_id"]) == (fire_at, "tiny", job["id"])
    assert record["late_s"] > 0


@pytest.mark.slow
def test_gana_form_and_opened_note_are_hoisted(runtime, producers, ray_cluster):
    gana = producers("gana", "g2", desired_model_id="tiny", max_new_tokens=4)
    notes = producers("extract", "notes", model_id="tiny", max_new_tokens=4)
    with device_held():
        ray_cluster.get(gana.open_page.remote())
        assert uniun_ray.status()["foreground"] == {"kind": "gana", "subject": "gana:g2"}
        interactive = gana.run.remote("Preview:")
        assert wait_for(lambda: queued("T1", producer="gana:g2", subject="gana:g2"), 10)

        opened = notes.open_note.remote("note-7")
        job = wait_for(lambda: queued("T1", producer="extract:notes"), 10)
        assert (job["subject"], job["foreground_hint"]) == ("note-7", True)
        assert uniun_ray.status()["foreground"] == {"kind": "extract", "subject": "note-7"}
        assert queued("T4", producer="gana:g2")   # the form lost the foreground to the note
    assert ray_cluster.get(opened, timeout=30).text is not None
    assert ray_cluster.get(interactive, timeout=30).model_id == "tiny"
    # the form closes after the note opened: the note keeps the foreground
    ray_cluster.get(gana.close_page.remote())
    assert uniun_ray.status()["foreground"] == {"kind": "extract", "subject": "note-7"}
    ray_cluster.get(notes.close_note.remote())
    assert uniun_ray.status()["foreground"]["kind"] is None


@pytest.mark.slow
def test_extract_backfill_submits_paced_plain_jobs(runtime, producers, ray_cluster):
    notes = producers("extract", "backfill", model_id="tiny", max_new_tokens=4)
    started = time.monotonic()
    summary = ray_cluster.get(notes.backfill.remote([f"n{i}" for i in range(4)], per_second=8.0), timeout=60)
    assert summary == {"submitted": 4, "done": 4, "failed": 0}, ray_cluster.get(notes.state.remote())
    assert time.monotonic() - started >= 3 / 8.0
    assert ray_cluster.get(notes.state.remote())["backfilled"] == 4
