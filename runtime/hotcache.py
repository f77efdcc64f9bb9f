"""The hot tier: caches kept in memory under a byte budget.

A cache in memory is "hot"; once dropped (evicted or discarded) it is "warm": on
disk, where the persistence actor wrote it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


def cache_nbytes(cache) -> int:
    """Bytes held by a per-layer list of QuantizedKVCache (each layer's `nbytes`)."""
    return sum(c.nbytes for c in cache if not c.empty())


class HotCaches:
    """In-memory ("hot") caches under a byte budget; the least recently used drop to warm.

    Thread-safe. Holds the only runtime reference to each cache it keeps, so dropping
    one (eviction, `discard`) frees its memory. A dropped cache is "warm": the
    persistence actor already holds or wrote its host copy.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._caches: OrderedDict = OrderedDict()  # agent -> (cache, nbytes)
        self._lock = threading.Lock()
        self.nbytes = 0

    def put(self, agent: str, cache) -> list[str]:
        """Keep `cache` as `agent`'s hot cache; return the agents evicted to make room.

        A cache larger than the whole budget is not kept (`agent` is then in the result).
        """
        size = cache_nbytes(cache)
        with self._lock:
            self._drop(agent)
            self._caches[agent] = (cache, size)
            self.nbytes += size
            evicted = []
            while self.nbytes > self.budget_bytes and self._caches:
                victim = next(iter(self._caches))
                self._drop(victim)
                evicted.append(victim)
            return evicted

    def get(self, agent: str):
        """`agent`'s hot cache (now the most recently used), or None."""
        with self._lock:
            entry = self._caches.get(agent)
            if entry is None:
                return None
            self._caches.move_to_end(agent)
            return entry[0]

    def discard(self, agent: str) -> None:
        """Forget `agent`'s hot cache, if any (the agent went away)."""
        with self._lock:
            self._drop(agent)

    def __contains__(self, agent) -> bool:
        return agent in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def _drop(self, agent: str) -> None:
        entry = self._caches.pop(agent, None)
        if entry is not None:
            self.nbytes -= entry[1]
