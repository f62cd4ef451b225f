"""The interface between the reconcile core's actions and whatever carries them out, and a
recording implementation for tests and simulators.

An `Actuator` starts actions and tells an `ActionSink` (the manager) how each went; the sink
answers an outcome with follow-up actions (a retry, a location update, a rebalance), which the
actuator runs as part of the same action, so the instance stays owned (`busy`) until they are
done. The gRPC implementation is `services.global_manager.actuator.GrpcActuator`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Protocol

from .actions import (
    Action,
    Count,
    DrainInstance,
    LoadInstances,
    MigrateRequests,
    Report,
    ResumeInstance,
    UpdateLocation,
)

__all__ = ["ActionSink", "Actuator", "RecordingActuator"]


class ActionSink(Protocol):
    """Where an actuator reports: events, load progress, and each action's outcome."""

    def report(self, action: Report | Count) -> None: ...

    def chain_tails(self, instance_ids: Collection[str]) -> None:
        """Targets that load last on their transfer chain (or alone): they go live (ZigZag)."""

    def load_upstreams(self, upstreams: dict[str, frozenset[str]]) -> None:
        """Per load target, the instances upstream of it on its transfer chain."""

    def load_progress(
        self, load: LoadInstances, iid: str, layers_loaded: int, groups_total: int, done: bool
    ) -> None: ...

    def load_finished(self, load: LoadInstances, iid: str, error: str) -> list[Action]:
        """The load on `iid` ended ("" error: done); the follow-ups to run."""
        ...

    def drain_finished(
        self, drain: DrainInstance, error: str, finished: int, aborted: int, *, resumed: bool = False
    ) -> list[Action]:
        """The drain of `drain.instance_id` ended ("" error); `resumed`: a resume took it back."""
        ...

    def resume_finished(self, action: ResumeInstance, error: str) -> list[Action]:
        """The worker answered a resume ("" error: it serves again)."""
        ...

    def released(self, action: MigrateRequests, moved: int | None) -> list[Action]:
        """How many requests `action.source` let go (None: it could not be asked)."""
        ...


class Actuator(Protocol):
    """Carries out the core's actions. `execute` returns at once (the work runs on); `busy` is
    what a load or drain in flight owns; `ready` says whether `execute` may be called yet."""

    ready: bool

    def execute(self, actions: Sequence[Action]) -> None: ...

    def busy(self) -> frozenset[str]: ...

    def sending(self) -> frozenset[str]:
        """The nodes whose links carry parameters to a load now (sources and middle hops of the
        transfer chains of loads not yet done)."""
        ...

    async def wait(self, instance_ids: Collection[str]) -> None:
        """Until the loads or drains of `instance_ids` are done."""

    async def list_models(self) -> list[str] | None:
        """The models the parameter manager lists (None: no parameter manager)."""
        ...

    async def probe(self, instance_id: str, timeout_s: float) -> str:
        """What `instance_id` answers when asked its status: its state's value ("SERVING",
        "IDLE", ...), "dead" (nothing listens on its address) or "silent" (no answer in time)."""
        ...

    def forget(self, instance_id: str) -> None:
        """`instance_id` left the cluster: drop what the actuator holds for it (a channel)."""

    async def aclose(self) -> None: ...


@dataclasses.dataclass
class RecordingActuator:
    """Records every action and lets the caller finish them, on its own (fake) clock: no I/O,
    no tasks. Reports and counts go straight to the sink, as a real actuator sends them;
    follow-ups of an outcome are recorded the same way."""

    sink: ActionSink | None = None
    models: list[str] | None = None
    ready: bool = True
    actions: list[Action] = dataclasses.field(default_factory=list)
    loading: dict[str, LoadInstances] = dataclasses.field(default_factory=dict)
    draining: dict[str, DrainInstance] = dataclasses.field(default_factory=dict)
    resuming: dict[str, ResumeInstance] = dataclasses.field(default_factory=dict)
    probes: dict[str, str] = dataclasses.field(default_factory=dict)  # instance id -> its probe's answer
    senders: set[str] = dataclasses.field(default_factory=set)  # what `sending` says: a test sets it

    def execute(self, actions: Sequence[Action]) -> None:
        assert self.sink is not None, "RecordingActuator needs a sink"
        for action in actions:
            if isinstance(action, (Report, Count)):
                self.sink.report(action)
                continue
            self.actions.append(action)
            if isinstance(action, LoadInstances):
                for iid in action.instance_ids:
                    self.loading[iid] = action
            elif isinstance(action, DrainInstance):
                self.draining[action.instance_id] = action
            elif isinstance(action, ResumeInstance):
                self.resuming[action.instance_id] = action

    def busy(self) -> frozenset[str]:
        return frozenset(self.loading) | frozenset(self.draining)

    def sending(self) -> frozenset[str]:
        return frozenset(self.senders)  # it plans no transfer chains: what the caller set

    async def wait(self, instance_ids: Collection[str]) -> None:
        return None

    async def list_models(self) -> list[str] | None:
        return self.models

    async def probe(self, instance_id: str, timeout_s: float) -> str:
        """What a test set in `probes` (default "silent": a recording actuator reaches no one)."""
        return self.probes.get(instance_id, "silent")

    def forget(self, instance_id: str) -> None:
        return None

    async def aclose(self) -> None:
        return None

    # ---- what a test or simulator drives --------------------------------------------------
    def of_type(self, kind: type) -> list[Action]:
        return [a for a in self.actions if isinstance(a, kind)]

    def progress(self, iid: str, layers_loaded: int, groups_total: int, done: bool = False) -> None:
        assert self.sink is not None
        self.sink.load_progress(self.loading[iid], iid, layers_loaded, groups_total, done)

    def finish_load(self, iid: str, error: str = "") -> None:
        """The load on `iid` ends (done, or failed with `error`)."""
        assert self.sink is not None
        load = self.loading[iid]
        follow = self.sink.load_finished(load, iid, error)
        del self.loading[iid]  # after the outcome, as a real actuator's task ends after it
        self.execute(follow)

    def finish_drain(
        self, iid: str, error: str = "", finished: int = 0, aborted: int = 0, *, resumed: bool = False
    ) -> None:
        """The drain of `iid` ends; `resumed`: a resume took it back (no location update, no
        unload), as the worker's Drain answers once its Resume is in."""
        assert self.sink is not None
        drain = self.draining[iid]
        if not error and not resumed:
            self.actions.append(UpdateLocation(drain.model, iid, present=False))
        follow = self.sink.drain_finished(drain, error, finished, aborted, resumed=resumed)
        del self.draining[iid]
        self.execute(follow)

    def finish_resume(self, iid: str, error: str = "") -> None:
        """The worker answers the resume of `iid` ("" error: it serves again)."""
        assert self.sink is not None
        self.execute(self.sink.resume_finished(self.resuming.pop(iid), error))

    def finish_release(self, action: MigrateRequests, moved: int | None) -> None:
        assert self.sink is not None
        self.execute(self.sink.released(action, moved))
