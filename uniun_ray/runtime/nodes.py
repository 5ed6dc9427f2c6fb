"""The cluster's nodes, as the scheduler follows them: a node that joins adds its devices to
the pool, one that dies takes its devices with it (SPEC §5, R20).

Ray's GCS keeps the node table and publishes every change to it: a node registered, a node
marked dead (it stopped, or its raylet missed the GCS health checks: `health_check_period_ms`
x `health_check_failure_threshold`, ~15 s by Ray's defaults, ~3 s on the heads uniun-ray starts,
see `head.NODE_HEALTH`). The scheduler subscribes to that channel as Ray's dashboard does, so
a dead node's devices leave the pool as soon as Ray knows, instead of when a job there waits
out a restart or the actor's name is freed.

`Node` and `describe` are plain data; `changes` is the Ray shell (the subscription uses Ray's
own `GcsAioNodeInfoSubscriber`, an internal module: pyproject pins Ray to one minor version).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Mapping

log = logging.getLogger(__name__)

#: How long the follower waits before subscribing again after the GCS went away (it restarts).
RESUBSCRIBE_S = 1.0
#: What Ray says of a dead node, by `NodeDeathInfo.Reason`.
_DEATHS = {0: "died", 1: "was stopped", 2: "died unexpectedly (its raylet stopped answering)",
           3: "was drained (preempted)", 4: "was drained (idle)"}


@dataclass(frozen=True)
class Node:
    """One Ray node as the GCS's node table has it."""

    id: str              # hex, as ray.get_runtime_context().get_node_id()
    address: str         # the node manager's IP
    alive: bool
    head: bool = False
    death: str = ""      # why it is dead, in Ray's words; "" while alive

    def named(self) -> str:
        """How logs and status name it: its address and the start of its id."""
        return f"{self.address} ({self.id[:8]})"


def from_row(row: Mapping) -> Node:
    """A row of `ray.nodes()`."""
    return Node(row["NodeID"], row.get("NodeManagerAddress", ""), bool(row.get("Alive")),
                "node:__internal_head__" in row.get("Resources", {}),
                "" if row.get("Alive") else "was gone when the scheduler started")


def from_info(info) -> Node:
    """A `GcsNodeInfo` the GCS published."""
    alive = info.state == 0  # GcsNodeInfo.ALIVE
    death = "" if alive else _DEATHS.get(info.death_info.reason, "died")
    if not alive and info.death_info.reason_message:
        death += f": {info.death_info.reason_message.splitlines()[0]}"
    return Node(info.node_id.hex(), info.node_manager_address, alive, info.is_head_node, death)


def describe(nodes: Iterable[Node], placed: Mapping[str, str | None]) -> list[dict]:
    """The live nodes with the devices on each (`placed`: device -> node id, None while not
    known yet), for status: the head first, then by address."""
    return [{"node": n.id, "address": n.address, "head": n.head,
             "devices": sorted(d for d, at in placed.items() if at == n.id)}
            for n in sorted(nodes, key=lambda n: (not n.head, n.address, n.id)) if n.alive]


async def changes(gcs_address: str) -> AsyncIterator[list[Node]]:
    """The node table, then every change to it as the GCS publishes it, for ever. The
    subscription comes before the table is read, so nothing between the two is missed (the
    dashboard's order); after a GCS restart it subscribes and reads the table again."""
    import ray
    from ray._private.gcs_pubsub import GcsAioNodeInfoSubscriber

    while True:
        subscriber = GcsAioNodeInfoSubscriber(address=gcs_address)
        try:
            await subscriber.subscribe()
            yield [from_row(row) for row in await asyncio.to_thread(ray.nodes)]
            while True:
                published = await subscriber.poll(batch_size=1000)
                if not published:  # a poll without a timeout ends empty only when the GCS is gone
                    raise ConnectionError("the GCS stopped answering the node subscription")
                yield [from_info(info) for _, info in published]
        except Exception:  # the GCS went away (it restarts): subscribe again
            log.exception("following the cluster's nodes failed; subscribing again")
        finally:
            await subscriber.close()
        await asyncio.sleep(RESUBSCRIBE_S)
