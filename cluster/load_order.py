"""Instances ordered by a load key, kept current in O(log n) per change (a heap with lazy deletion).

The router changes an instance's load on every route, finish and poll; dispatch asks for the least loaded.
Re-ranking a fleet of a thousand instances on every request would cost milliseconds in Python, so each change
pushes the instance's new key and a lookup skips the stale entries it meets (each is popped once). The heap is
rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable


class LoadOrder:
    """Instance id -> its current key; `first()` is the id with the smallest key."""

    def __init__(self) -> None:
        self._key: dict[str, tuple] = {}
        self._heap: list[tuple[tuple, str]] = []

    def set(self, instance_id: str, key: tuple[Hashable, ...]) -> None:
        if self._key.get(instance_id) == key:
            return
        self._key[instance_id] = key
        heapq.heappush(self._heap, (key, instance_id))
        if len(self._heap) > 4 * len(self._key) + 64:
            self._heap = [(k, i) for i, k in self._key.items()]
            heapq.heapify(self._heap)

    def discard(self, instance_id: str) -> None:
        self._key.pop(instance_id, None)

    def first(self) -> str | None:
        while self._heap:
            key, instance_id = self._heap[0]
            if self._key.get(instance_id) == key:
                return instance_id
            heapq.heappop(self._heap)
        return None

    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self._key

    def __len__(self) -> int:
        return len(self._key)
