"""The prefix KV cache as the simulator sees it: how many of a run's tokens need no prefill.

It mirrors `uniun_ray.models.kv.prefix` at the level a workload describes: a revoked job's KV
(prompt + what it produced, or the prefill chunks it read) is kept for its resume, and a
conversation's last turn (prompt + reply) for its next turn, whose prompt starts with it. Per
device, least recently used first, within a budget in tokens; a swap empties it (the real
engine drops the unloaded model's cache). Pure and clock-free like the rest of the simulator.
"""
from __future__ import annotations

from collections import OrderedDict


class KvCache:
    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self._entries: OrderedDict[str, int] = OrderedDict()   # key -> cached tokens, oldest first

    def take(self, job_key: str, conversation_key: str | None, context_tokens: int) -> int:
        """Cached tokens of a run's context (at most all but the last token, which the run needs
        to read for its logits). A job's own entry (its resume) is taken over; a conversation's
        is shared."""
        if job_key in self._entries:
            cached = self._entries.pop(job_key)
        elif conversation_key is not None and conversation_key in self._entries:
            self._entries.move_to_end(conversation_key)
            cached = self._entries[conversation_key]
        else:
            return 0
        return max(0, min(cached, context_tokens - 1))

    def put(self, key: str, tokens: int) -> None:
        if self.budget_tokens <= 0 or tokens <= 0 or tokens > self.budget_tokens:
            return
        self._entries.pop(key, None)
        self._entries[key] = tokens
        while sum(self._entries.values()) > self.budget_tokens:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
