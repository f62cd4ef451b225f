"""The instance table: the core's registry plus each instance's addresses, fed from worker
messages (protobuf).

Workers are the source of truth for their own state; the registry follows what they report,
through legal transitions, and rebuilds itself from re-registration after a restart.
"""

from __future__ import annotations

import dataclasses

import structlog

from blitzmesh.v1 import common_pb2
from services.global_manager.convert import (
    role_from_proto,
    role_to_proto,
    sample_to_proto,
    state_from_proto,
    state_to_proto,
)
from services.global_manager.core.instances import Registry, is_legal_transition
from services.global_manager.core.types import InstanceState, InstanceView

log = structlog.get_logger(__name__)


@dataclasses.dataclass(slots=True)
class Suspicion:
    """A gateway reported the instance failed (`ReportInstanceFailure`): until the manager's
    probe clears it (or it re-registers, or goes LOST) no route goes there, no transfer plan
    names it as a source and it counts as no capacity. `probing`: the probe has not answered
    yet; once it has given up (no answer), a heartbeat clears the suspicion."""

    reported_s: float
    reason: str
    probing: bool = True


class InstanceTable:
    """The registry plus what only the adapter needs: each instance's addresses, and the
    instances a gateway reported failed (`suspects`)."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.addresses: dict[str, str] = {}
        self.dataplane: dict[str, tuple[bytes, str]] = {}
        self.suspects: dict[str, Suspicion] = {}
        # Each loaded instance's dtype and kernel choices, as its last message reported them.
        self.engines: dict[str, common_pb2.EngineInfo] = {}

    def upsert(self, info: common_pb2.InstanceInfo, now_s: float) -> InstanceView:
        """Register (or re-register) a worker in the state it reports."""
        iid = info.instance_id
        state = state_from_proto(info.state)
        self.suspects.pop(iid, None)  # a new incarnation: whatever failed was the old one
        if iid in self.registry:
            self.registry.mark_lost(iid)
            self.registry.remove(iid)
        view = self.registry.register(
            iid,
            model=info.model_id,
            role=role_from_proto(info.role),
            host=info.host,
            # An idle worker holds no model; the core counts layers against at least one.
            num_layers=max(info.num_layers, 1),
            now_s=now_s,
            state=state,
            layers_loaded=min(info.layers_loaded, max(info.num_layers, 1)),
        )
        self.addresses[iid] = info.address
        self.dataplane[iid] = (info.dataplane_address, info.dataplane_kind)
        self.note_engine(iid, info.engine if info.HasField("engine") else None)
        return view

    def note_engine(self, iid: str, engine: common_pb2.EngineInfo | None) -> None:
        """Keep what a worker reports of its engine (None: it holds no model now)."""
        if engine is None:
            self.engines.pop(iid, None)
        else:
            self.engines[iid] = engine

    def follow(self, iid: str, state: InstanceState, model: str, layers_loaded: int, num_layers: int) -> InstanceView:
        """Bring the registry to the state a worker reports, via legal transitions."""
        view = self.registry.get(iid)
        if view.state is state:
            if state is InstanceState.LOADING and layers_loaded > view.layers_loaded:
                return self.registry.set_layers_loaded(iid, min(layers_loaded, view.num_layers))
            return view
        if is_legal_transition(view.state, state):
            kwargs = {}
            if view.state is InstanceState.IDLE and state is InstanceState.LOADING:
                kwargs = {"model": model, "num_layers": max(num_layers, 1)}
            return self.registry.transition(iid, state, **kwargs)
        # A jump the state machine does not allow (a missed heartbeat, a failed load going back
        # to IDLE): write the old view off and take the worker's word for where it is now.
        log.info("instance_resync", instance_id=iid, registry=view.state.value, reported=state.value)
        self.registry.mark_lost(iid)
        self.registry.remove(iid)
        return self.registry.register(
            iid,
            model=model,
            role=view.role,
            host=view.host,
            num_layers=max(num_layers, 1),
            now_s=view.last_heartbeat_s,
            state=state,
            layers_loaded=min(layers_loaded, max(num_layers, 1)),
        )

    def learn_num_layers(self, iid: str, model: str, num_layers: int) -> InstanceView:
        """Take the layer count a worker reports for the model it holds or loads (the manager
        assigned the model without knowing its size); anything else is left alone."""
        view = self.registry.get(iid)
        live = (InstanceState.LOADING, InstanceState.SERVING, InstanceState.DRAINING)
        if view.state in live and model and model == view.model and 0 < num_layers != view.num_layers:
            return self.registry.set_num_layers(iid, num_layers)
        return view

    def to_proto(self, view: InstanceView, now_s: float) -> common_pb2.InstanceInfo:
        load = view.load
        dp_addr, dp_kind = self.dataplane.get(view.instance_id, (b"", ""))
        info = common_pb2.InstanceInfo(
            instance_id=view.instance_id,
            address=self.addresses.get(view.instance_id, ""),
            host=view.host,
            model_id=view.model,
            state=state_to_proto(view.state),
            role=role_to_proto(view.role),
            layers_loaded=view.layers_loaded,
            num_layers=view.num_layers if view.model else 0,
            dataplane_address=dp_addr,
            dataplane_kind=dp_kind,
            last_heartbeat_age_s=max(0.0, now_s - view.last_heartbeat_s),
        )
        if load is not None:
            info.load.CopyFrom(sample_to_proto(load))
        engine = self.engines.get(view.instance_id)
        if engine is not None:
            info.engine.CopyFrom(engine)
        return info
