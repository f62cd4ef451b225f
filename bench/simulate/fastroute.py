"""The gateway's routing choice without a pass over every instance per request.

`plan_route` (the core's) looks at every view for each request: at 1,000 instances and
thousands of requests a second that is most of a simulation's time. For a colocated deployment
asked with no exclusions its answer is the SERVING instance with the smallest
(fits, `instance_load`, instance_id), fits meaning its free KV blocks hold the request. That
load changes only when the instance's view does (a heartbeat, a route noted, a transition), so
`IndexedRegistry` (the core's `Registry`, told of every view it stores) keeps those instances in a
heap by (load, id) with stale entries dropped when they surface. `LeastLoaded.route` answers
from the heap top (the first not excluded) when it fits, and says "ask `plan_route`" (None) in every
other case: some PREFILL or DECODE instance serving, or that instance short of KV.
The answer is the very view `plan_route` would return; a unit test runs both side by side.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Sequence

from services.global_manager.core.instances import Registry
from services.global_manager.core.routing import instance_load
from services.global_manager.core.types import InstanceState, InstanceView, Role

__all__ = ["IndexedRegistry", "LeastLoaded"]


class LeastLoaded:
    """SERVING instances of one model by (instance_load, instance_id), kept as views change."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.current: dict[str, InstanceView] = {}  # SERVING colocated views, by id
        self.split: set[str] = set()  # SERVING prefill or decode instances
        # (instance_load, id, sequence, token, routes noted in a `route_many` batch): an entry
        # is current while its token is its instance's and, in a batch, its count of routes
        # noted there is too. The token is the view the entry was pushed for; a new view whose
        # load is the same float keeps the entry (most reports of a quiet instance), and the
        # answer is the instance's current view.
        self._heap: list[tuple[float, str, int, InstanceView, int]] = []
        self._token: dict[str, InstanceView] = {}
        self._load: dict[str, float] = {}  # the load of each token's entry outside a batch
        self._n = 0
        self._noted: dict[str, int] = {}  # empty outside `route_many`

    def update(self, iid: str, view: InstanceView | None) -> None:
        """`iid`'s view is now `view` (None: removed)."""
        self.current.pop(iid, None)
        self._token.pop(iid, None)
        self._load.pop(iid, None)
        self.split.discard(iid)
        if view is None or view.state is not InstanceState.SERVING or view.model != self.model:
            return
        if view.role is not Role.COLOCATED:
            self.split.add(iid)
            return
        self.refresh(iid, view)

    def refresh(self, iid: str, view: InstanceView) -> None:
        """`iid`, indexed, has a new view of the same state, role and model (a report, a route
        noted): the new load goes in, the old entry goes stale."""
        self.current[iid] = view
        load = instance_load(view)
        if self._load.get(iid) == load:
            return  # its entry's key stands
        self._token[iid] = view
        self._load[iid] = load
        self._n += 1
        heapq.heappush(self._heap, (load, iid, self._n, view, 0))
        if len(self._heap) > 4 * len(self.current) + 256:
            self._rebuild()

    def _rebuild(self) -> None:
        self._n += 1
        noted = self._noted
        self._heap = [
            (instance_load(v, noted.get(iid, 0)), iid, self._n, v, noted.get(iid, 0)) for iid, v in self.current.items()
        ]
        heapq.heapify(self._heap)
        self._token = dict(self.current)
        # An instance with routes noted in a batch has no entry for after it: its next view pushes one.
        self._load = {e[1]: e[0] for e in self._heap if not e[4]}

    def route(
        self, request_tokens: int, block_size: int, exclude: Collection[str] = ()
    ) -> tuple[InstanceView, ...] | None:
        """What `plan_route` returns for a request of `request_tokens` (prompt + max tokens) with
        `exclude` left out, or None when only `plan_route` can tell."""
        if self.split:
            return None
        heap, token, noted = self._heap, self._token, self._noted
        passed = []  # current entries of excluded instances, put back after
        top = None
        while heap:
            entry = heap[0]
            if token.get(entry[1]) is not entry[3] or entry[4] != (noted.get(entry[1], 0) if noted else 0):
                heapq.heappop(heap)  # stale
            elif entry[1] in exclude:
                passed.append(heapq.heappop(heap))
            else:
                top = self.current[entry[1]]
                break
        for entry in passed:
            heapq.heappush(heap, entry)
        if top is None:
            return ()
        return (top,) if _fits(top, request_tokens, block_size) else None

    def route_many(
        self, request_tokens: Sequence[int], block_size: int, exclude: Collection[str], dead: Collection[str]
    ) -> list[InstanceView]:
        """The instances `route` answers for requests of `request_tokens` asked one after another,
        each counted (`Registry.note_routed`) before the next is asked: the rebalance after a
        load re-routes dozens of queued requests at once, and this answers them with one heap
        entry per request instead of a new view, a registry write and an entry. Each answer's
        load is `instance_load` with the batch's routes added, the float the noted view would
        give. The registry is not touched: the caller notes the routes (`note_routed(iid, n)`),
        which puts the exact entries in. Stops before the first request the index cannot
        answer alone (the least loaded instance short of KV room, a split pool) or whose
        answer is in `dead` (a refused connection): that one and the rest are the caller's."""
        chosen: list[InstanceView] = []
        noted = self._noted
        try:
            for tokens in request_tokens:
                top = self.route(tokens, block_size, exclude)
                if not top or top[0].instance_id in dead:
                    break
                view = top[0]
                iid = view.instance_id
                chosen.append(view)
                n = noted[iid] = noted.get(iid, 0) + 1
                self._n += 1
                heapq.heappush(self._heap, (instance_load(view, n), iid, self._n, self._token[iid], n))
        finally:
            noted.clear()  # the batch's entries go stale; the caller's notes replace them
        return chosen


def _fits(view: InstanceView, request_tokens: int, block_size: int) -> bool:
    """The router's KV check: free blocks hold the request, or the instance reported no cache."""
    load = view.load
    if load is None or load.kv_blocks_total == 0:
        return True
    return load.kv_blocks_total - load.kv_blocks_used >= math.ceil(request_tokens / block_size)


class IndexedRegistry(Registry):
    """The core's `Registry`, unchanged in behaviour, with a `LeastLoaded` index of `model` and
    the instances that are not IDLE, so a heartbeat round need not visit a thousand idle ones."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.index = LeastLoaded(model)
        self.idle: set[str] = set()
        self._active: set[str] = set()
        self._position: dict[str, int] = {}  # the table's order: dicts keep insertion order
        self._added = 0
        # Bumped when an instance comes or goes or its state, model or load report changes (not
        # on a route noted or a layer landed): what the ZigZag gate reads is the same until then.
        self.version = 0
        # Bumped only when an instance comes or goes or its state, role or model changes.
        self.state_version = 0

    def _put(self, iid: str, old: InstanceView | None, view: InstanceView) -> None:
        self._views[iid] = view
        if old is not None and old.state is view.state and old.role is view.role and old.model == view.model:
            # A report, a route noted, a layer landed (the hot case): the same sets.
            if old.load is not view.load:
                self.version += 1
            if iid in self.index.current:
                self.index.refresh(iid, view)
            return
        self._changed(iid, view)

    def _drop(self, iid: str, old: InstanceView) -> None:
        del self._views[iid]
        self._changed(iid, None)

    def _changed(self, iid: str, view: InstanceView | None) -> None:
        """`iid` came, went, or changed state, role or model."""
        self.version += 1
        self.state_version += 1
        self.index.update(iid, view)
        self.idle.discard(iid)
        self._active.discard(iid)
        if view is None:
            self._position.pop(iid, None)  # back at the end of the table if it comes back
            return
        if iid not in self._position:
            self._position[iid] = self._added
            self._added += 1
        (self.idle if view.state is InstanceState.IDLE else self._active).add(iid)

    def active(self) -> list[InstanceView]:
        """The views not IDLE, in the order iterating the registry gives them."""
        views = self._views
        return [views[iid] for iid in sorted(self._active, key=self._position.__getitem__)]
