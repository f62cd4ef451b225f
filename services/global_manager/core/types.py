"""Value types shared by the global manager's pure core: instances, heartbeats, snapshots, decisions.

Everything here is a frozen dataclass or an enum so the core can pass values around without
defensive copies; adapters convert protobuf messages to and from these at the process boundary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

__all__ = [
    "DECISION_LOG_HEADER",
    "ClusterSnapshot",
    "InstanceState",
    "InstanceView",
    "LoadSample",
    "PoolSnapshot",
    "Role",
    "ScaleAction",
    "ScaleDecision",
]


class InstanceState(str, Enum):
    """Lifecycle of one worker as the registry sees it (see `router.Registry` for transitions)."""

    IDLE = "IDLE"
    LOADING = "LOADING"
    SERVING = "SERVING"
    DRAINING = "DRAINING"
    LOST = "LOST"


class Role(str, Enum):
    """What an instance does: both phases (colocated) or one side of a prefill/decode split."""

    COLOCATED = "COLOCATED"
    PREFILL = "PREFILL"
    DECODE = "DECODE"


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One heartbeat from one instance, stamped with the manager's clock (`now_s`).

    Latency fields are None when the instance finished no request (TTFT) or produced no second
    token (TBT) since its previous heartbeat: "no observation", which is not the same as zero.
    """

    instance_id: str
    now_s: float
    decode_tps: float = 0.0
    prefill_tps: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tbt_p50_s: float | None = None
    tbt_p99_s: float | None = None
    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    zigzag_running: int = 0  # ZigZag requests running their first layers there (a loading instance)
    zigzag_relayed_total: int = 0
    zigzag_continued_total: int = 0
    # SLO-aware engine: its TPOT estimate for the running set (None = no estimate yet), and the
    # requests it refused for an SLO or paused so far.
    est_tpot_s: float | None = None
    slo_rejected_total: int = 0
    preempted_total: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from cached KV blocks, since start
    prefix_query_tokens: int = 0
    # Prompt tokens per second the instance computes while prefilling (its recent prefill steps),
    # not the demand it served; 0 = not measured yet (no prefill step).
    prefill_capacity_tps: float = 0.0

    def __post_init__(self) -> None:
        # Cheap checks only: heartbeats arrive at (instances x Hz) and a bad one must be loud.
        if not self.instance_id:
            raise ValueError("LoadSample.instance_id must be non-empty")
        if (
            self.decode_tps >= 0
            and self.prefill_tps >= 0
            and self.running >= 0
            and self.waiting >= 0
            and self.waiting_prefill_tokens >= 0
            and self.prefill_capacity_tps >= 0
            and 0 <= self.kv_blocks_used <= self.kv_blocks_total
        ):
            return  # the common case, without the loop below that names the bad field
        for name in (
            "decode_tps",
            "prefill_tps",
            "running",
            "waiting",
            "waiting_prefill_tokens",
            "prefill_capacity_tps",
            "kv_blocks_used",
            "kv_blocks_total",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"LoadSample.{name} must be >= 0, got {value!r} (instance {self.instance_id!r})")
        if self.kv_blocks_used > self.kv_blocks_total:
            raise ValueError(
                f"LoadSample.kv_blocks_used={self.kv_blocks_used!r} exceeds "
                f"kv_blocks_total={self.kv_blocks_total!r} (instance {self.instance_id!r})"
            )

    @property
    def kv_utilization(self) -> float:
        """Fraction of KV blocks in use; 0 when the instance reports no KV cache yet."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class InstanceView:
    """The registry's view of one worker. `load` is its latest heartbeat, None before the first.

    `routes_since_heartbeat` counts the requests routed to it after that heartbeat: the report
    cannot show them yet, and without them a burst inside one heartbeat period would all land on
    the instance that looked least loaded at its start.
    """

    instance_id: str
    model: str
    role: Role
    state: InstanceState
    layers_loaded: int
    num_layers: int
    host: str
    last_heartbeat_s: float
    load: LoadSample | None = None
    routes_since_heartbeat: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.layers_loaded <= self.num_layers:
            raise ValueError(
                f"InstanceView {self.instance_id!r}: layers_loaded={self.layers_loaded!r} "
                f"outside [0, num_layers={self.num_layers!r}]"
            )
        if self.routes_since_heartbeat < 0:
            raise ValueError(
                f"InstanceView {self.instance_id!r}: routes_since_heartbeat={self.routes_since_heartbeat!r} must be >= 0"
            )


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Window aggregates of one role's pool, as the policies consume them.

    Capacity (`count`) is SERVING + LOADING: an instance that is still receiving layers was
    already paid for by a scale-out, so counting it stops the policy from ordering it twice.
    Load fields include DRAINING instances too, because their in-flight requests are real load.
    Rates are per-instance window means summed over the pool; latencies are quantiles over all
    samples of the pool in the window (None when no sample carried that latency).
    """

    role: Role
    serving: int = 0
    loading: int = 0
    draining: int = 0
    instances_reporting: int = 0
    decode_tps: float = 0.0
    prefill_tps: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tbt_p50_s: float | None = None
    tbt_p99_s: float | None = None
    running: float = 0.0
    waiting: float = 0.0
    waiting_prefill_tokens: float = 0.0
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    # From each instance's latest heartbeat in the window, summed over the pool: its measured
    # prefill capacity (LoadSample.prefill_capacity_tps), whether it has one (0/1), the seconds
    # its queued prompt tokens wait at it, and the queued tokens of one without a capacity.
    prefill_capacity_tps: float = 0.0
    prefill_measured: float = 0.0
    prefill_wait_s: float = 0.0
    unmeasured_prefill_tokens: float = 0.0

    @property
    def count(self) -> int:
        """Instances the policies treat as capacity: SERVING + LOADING."""
        return self.serving + self.loading

    @property
    def kv_utilization(self) -> float | None:
        """Pool-wide KV use; None when no instance reported a KV cache in the window."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total > 0 else None

    @property
    def kv_blocks_per_instance(self) -> float | None:
        """Mean KV capacity of a reporting instance; None when none reported one."""
        if self.instances_reporting == 0 or self.kv_blocks_total <= 0:
            return None
        return self.kv_blocks_total / self.instances_reporting

    def tbt_s(self, percentile: Literal["p50", "p99"]) -> float | None:
        return self.tbt_p50_s if percentile == "p50" else self.tbt_p99_s


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything a policy sees at one tick, for one deployment (one model).

    `disaggregated` says whether the deployment splits prefill and decode; a colocated deployment
    keeps all its numbers in the COLOCATED pool.
    """

    now_s: float
    pools: dict[Role, PoolSnapshot]
    disaggregated: bool
    model: str | None = None

    def pool(self, role: Role) -> PoolSnapshot:
        return self.pools.get(role) or PoolSnapshot(role=role)

    @property
    def prefill(self) -> PoolSnapshot:
        return self.pool(Role.PREFILL)

    @property
    def decode(self) -> PoolSnapshot:
        return self.pool(Role.DECODE)

    @property
    def colocated(self) -> PoolSnapshot:
        return self.pool(Role.COLOCATED)

    @property
    def token_pool(self) -> PoolSnapshot:
        """The pool that produces output tokens: DECODE when split, COLOCATED otherwise."""
        return self.decode if self.disaggregated else self.colocated

    @property
    def decode_tps(self) -> float:
        """Decode TPS of the whole deployment (the HeteroScale input)."""
        return self.token_pool.decode_tps


ScaleAction = Literal["scale_out", "scale_in", "no_change"]
_ACTIONS: frozenset[str] = frozenset({"scale_out", "scale_in", "no_change"})

#: Column names of `ScaleDecision.to_log_line()`, in the reference simulator's order.
DECISION_LOG_HEADER = "time,action,target,status,reason"


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What a policy wants at `now_s`, with the reason, for a split or a colocated deployment.

    A split deployment sets prefill_* and decode_*; a colocated one sets instances_*. `action`
    follows the rule that fired, so when the P:D mix is off ratio one pool may move against it
    (a scale-in that rebalances can still add a prefill instance). `extra` carries the numbers
    behind the decision (ratio, need, tbt_s) for metrics and simulators; it is not logged.
    """

    action: ScaleAction
    reason: str
    policy: str
    now_s: float
    prefill_from: int | None = None
    prefill_to: int | None = None
    decode_from: int | None = None
    decode_to: int | None = None
    instances_from: int | None = None
    instances_to: int | None = None
    extra: Mapping[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"ScaleDecision.action must be one of {sorted(_ACTIONS)}, got {self.action!r}")
        split = (self.prefill_from, self.prefill_to, self.decode_from, self.decode_to)
        single = (self.instances_from, self.instances_to)
        split_ok = all(v is not None for v in split) and all(v is None for v in single)
        single_ok = all(v is not None for v in single) and all(v is None for v in split)
        if not (split_ok or single_ok):
            raise ValueError(
                "ScaleDecision needs either all of prefill_from/prefill_to/decode_from/decode_to "
                f"(split) or only instances_from/instances_to (colocated); got prefill={split[:2]!r} "
                f"decode={split[2:]!r} instances={single!r}"
            )
        for name, value in zip(
            ("prefill_from", "prefill_to", "decode_from", "decode_to", "instances_from", "instances_to"),
            split + single,
            strict=True,
        ):
            if value is not None and value < 0:
                raise ValueError(f"ScaleDecision.{name} must be >= 0, got {value!r}")
        if (self.action == "no_change") == self.changes_anything:
            raise ValueError(f"ScaleDecision action {self.action!r} disagrees with its counts {self.target_str()!r}")

    @property
    def is_colocated(self) -> bool:
        return self.instances_from is not None

    @property
    def changes_anything(self) -> bool:
        if self.is_colocated:
            return self.instances_from != self.instances_to
        return self.prefill_from != self.prefill_to or self.decode_from != self.decode_to

    def delta(self, role: Role) -> int:
        """Instances to add (positive) or remove (negative) in one pool."""
        if role is Role.COLOCATED:
            return (self.instances_to or 0) - (self.instances_from or 0)
        if role is Role.PREFILL:
            return (self.prefill_to or 0) - (self.prefill_from or 0)
        return (self.decode_to or 0) - (self.decode_from or 0)

    def target_str(self) -> str:
        """Count changes as the reference logs them: prompt = prefill pool, token = decode pool."""
        if self.is_colocated:
            return f"instances:{self.instances_from}->{self.instances_to}"
        return f"prompt:{self.prefill_from}->{self.prefill_to}_token:{self.decode_from}->{self.decode_to}"

    def to_log_line(self) -> str:
        """`time,action,target,status,reason` (the reference's columns, filled as it fills them).

        Commas and newlines in the reason would break the CSV, so they become ';' and ' '.
        """
        reason = self.reason.replace(",", ";").replace("\n", " ")
        return f"{_fmt_time(self.now_s)},autoscaling_decision,{self.action},{self.target_str()},{reason}"


def _fmt_time(now_s: float) -> str:
    # repr keeps full precision and renders whole seconds as "30.0", like the reference.
    value = float(now_s)
    return repr(value) if math.isfinite(value) else str(value)
