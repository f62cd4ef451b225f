"""Where prompts' KV blocks probably are, for prefix-affinity routing (Dynamo's KV-aware router,
in its approximate mode): instance -> the chained block hashes of prompts recently routed there.

Approximate on purpose: the manager never sees a worker's cache, only what it routed. A worker
may have evicted blocks the index still lists, or cached blocks it never routed (the index
keeps at most `max_blocks_per_instance` per instance); either costs a less fitting choice, not a
wrong answer, as the worker looks every prompt up itself. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .types import InstanceState, InstanceView

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Per instance, a bounded LRU set of block hashes, tagged with the model they were routed
    for: an instance that leaves SERVING (drains, unloads, is lost) or serves another model
    starts empty, as its worker's cache does."""

    def __init__(self, max_blocks_per_instance: int) -> None:
        if max_blocks_per_instance <= 0:
            raise ValueError(f"max_blocks_per_instance must be > 0, got {max_blocks_per_instance!r}")
        self.max_blocks_per_instance = max_blocks_per_instance
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._model: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._blocks

    def blocks_of(self, instance_id: str) -> int:
        """Hashes remembered for `instance_id`."""
        return len(self._blocks.get(instance_id, ()))

    def record(self, instance_id: str, model: str, hashes: Sequence[int]) -> None:
        """A prompt with these block hashes was routed to `instance_id` (serving `model`), which
        will compute and cache its blocks: remember them as the most recent."""
        if self._model.get(instance_id) != model:
            self.forget(instance_id)
            self._model[instance_id] = model
        blocks = self._blocks.setdefault(instance_id, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks_per_instance:
            blocks.popitem(last=False)

    def overlap(self, instance_id: str, model: str, hashes: Sequence[int]) -> int:
        """How many of the prompt's first blocks `instance_id` probably holds: the leading run
        of `hashes` it has seen (a block's hash chains all before it, so the run ends at the
        first miss)."""
        if self._model.get(instance_id) != model:
            return 0
        blocks = self._blocks[instance_id]
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def overlaps(self, views: Iterable[InstanceView], hashes: Sequence[int]) -> dict[str, int]:
        """`overlap` of each view (for its model), those with none left out."""
        out: dict[str, int] = {}
        for view in views:
            n = self.overlap(view.instance_id, view.model, hashes)
            if n:
                out[view.instance_id] = n
        return out

    def forget(self, instance_id: str) -> None:
        """Drop what is known of `instance_id` (it left, or its cache was emptied)."""
        self._blocks.pop(instance_id, None)
        self._model.pop(instance_id, None)

    def sync(self, views: Iterable[InstanceView]) -> None:
        """Keep only instances SERVING (or LOADING: a live one runs ZigZag first layers, whose
        prompt blocks are whole once the load completes under them) the model they were
        recorded for; `views` lists every instance the registry knows (one missing is gone)."""
        kept = (InstanceState.SERVING, InstanceState.LOADING)
        serving = {v.instance_id: v.model for v in views if v.state in kept}
        for iid in [i for i in self._blocks if serving.get(i) != self._model.get(i)]:
            self.forget(iid)
