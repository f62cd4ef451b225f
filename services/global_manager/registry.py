"""Adapter between worker messages (protobuf) and the pure core's registry.

Workers are the source of truth for their own state; the registry follows what they report,
through legal transitions, and rebuilds itself from re-registration after a restart.
"""

from __future__ import annotations

import structlog

from blitzmesh import convert
from blitzmesh.types import LoadReport
from blitzmesh.v1 import common_pb2
from services.global_manager.core.router import Registry, is_legal_transition
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role

log = structlog.get_logger(__name__)

# The wire enums map through the SDK's one table each (`blitzmesh.convert`); the core's enums are
# the SDK's names in upper case ("serving" <-> InstanceState.SERVING).


def state_from_proto(value: int) -> InstanceState:
    """UNSPECIFIED, and a value this build does not know, read as IDLE: a worker that says nothing
    about its model holds none that the manager may route to."""
    name = convert.instance_state_from_proto(value)
    return InstanceState.IDLE if name == "unspecified" else InstanceState(name.upper())


def state_to_proto(state: InstanceState) -> common_pb2.InstanceState.ValueType:
    return convert.instance_state_to_proto(state.value.lower())


def role_from_proto(value: int) -> Role:
    """UNSPECIFIED reads as COLOCATED (the default deployment).

    Raises:
        ValueError: for a value this build does not know; guessing a role would misplace the
            instance in the prefill/decode pools.
    """
    name = convert.instance_role_from_proto(value)
    if name != "unspecified":
        return Role(name.upper())
    if value != common_pb2.INSTANCE_ROLE_UNSPECIFIED:
        raise ValueError(f"unknown InstanceRole value {value!r}")
    return Role.COLOCATED


def role_to_proto(role: Role) -> common_pb2.InstanceRole.ValueType:
    return convert.instance_role_to_proto(role.value.lower())


def sample_from_proto(instance_id: str, now_s: float, msg: common_pb2.LoadReport) -> LoadSample:
    """A worker's LoadReport as the core's LoadSample (tokens_generated_total is not kept)."""
    load = convert.load_report_from_proto(msg)

    # A worker reports 0 latency when it observed none; the core wants None for "no observation".
    def opt(v: float) -> float | None:
        return v if v > 0 else None

    return LoadSample(
        instance_id=instance_id,
        now_s=now_s,
        decode_tps=load.decode_tps,
        prefill_tps=load.prefill_tps,
        ttft_p50_s=opt(load.ttft_p50_s),
        ttft_p99_s=opt(load.ttft_p99_s),
        tbt_p50_s=opt(load.tbt_p50_s),
        tbt_p99_s=opt(load.tbt_p99_s),
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        zigzag_running=load.zigzag_running,
        zigzag_relayed_total=load.zigzag_relayed_total,
        zigzag_continued_total=load.zigzag_continued_total,
        est_tpot_s=opt(load.est_tpot_s),
        slo_rejected_total=load.slo_rejected_total,
        preempted_total=load.preempted_total,
        prefix_hit_tokens=load.prefix_hit_tokens,
        prefix_query_tokens=load.prefix_query_tokens,
    )


def sample_to_proto(sample: LoadSample) -> common_pb2.LoadReport:
    """The inverse of `sample_from_proto`: "no observation" goes back on the wire as 0."""
    return convert.load_report_to_proto(
        LoadReport(
            decode_tps=sample.decode_tps,
            prefill_tps=sample.prefill_tps,
            ttft_p50_s=sample.ttft_p50_s or 0.0,
            ttft_p99_s=sample.ttft_p99_s or 0.0,
            tbt_p50_s=sample.tbt_p50_s or 0.0,
            tbt_p99_s=sample.tbt_p99_s or 0.0,
            running=sample.running,
            waiting=sample.waiting,
            waiting_prefill_tokens=sample.waiting_prefill_tokens,
            kv_blocks_used=sample.kv_blocks_used,
            kv_blocks_total=sample.kv_blocks_total,
            zigzag_running=sample.zigzag_running,
            zigzag_relayed_total=sample.zigzag_relayed_total,
            zigzag_continued_total=sample.zigzag_continued_total,
            est_tpot_s=sample.est_tpot_s or 0.0,
            slo_rejected_total=sample.slo_rejected_total,
            preempted_total=sample.preempted_total,
            prefix_hit_tokens=sample.prefix_hit_tokens,
            prefix_query_tokens=sample.prefix_query_tokens,
        )
    )


class InstanceTable:
    """The registry plus what only the adapter needs: each instance's addresses."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.addresses: dict[str, str] = {}
        self.dataplane: dict[str, tuple[bytes, str]] = {}

    def upsert(self, info: common_pb2.InstanceInfo, now_s: float) -> InstanceView:
        """Register (or re-register) a worker in the state it reports."""
        iid = info.instance_id
        state = state_from_proto(info.state)
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
        return view

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
        return info
