"""Autoscaling policies: pure `decide(now_s, snapshot) -> ScaleDecision` rules (docs/algorithms.md 1).

Each policy owns exactly one piece of mutable state, its `CooldownState`, updated when it
returns a scale decision; everything else comes from the snapshot. `make_policy(name, params)`
builds one from a name and a plain dict so the manager can switch and tune policies at run time.

Split (prefill/decode) and colocated deployments share the interface: a colocated deployment is
one pool, and each policy says below how its rule maps onto it. Every policy first repairs pool
sizes outside [min, max] (a hard bound, not subject to cooldowns), then applies its rule.

Rounding helpers subtract or add 1e-9 before ceil/floor: products such as 30 * 1.2 can land a
hair above an integer, and ceil must not turn 36.000000000000004 into 37.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common.worker_profile import load_profile

from .types import ClusterSnapshot, PoolSnapshot, Role, ScaleAction, ScaleDecision

__all__ = [
    "BlitzScaleBoundsConfig",
    "BlitzScaleBoundsPolicy",
    "CooldownState",
    "HeteroScaleConfig",
    "HeteroScalePolicy",
    "LatencyConfig",
    "LatencyPolicy",
    "PeriodicConfig",
    "PeriodicPolicy",
    "Policy",
    "ScheduleEntry",
    "UtilizationConfig",
    "UtilizationPolicy",
    "make_policy",
    "policy_names",
    "queue_wait_s",
]

_EPS = 1e-9
Percentile = Literal["p50", "p99"]


def ceil_eps(x: float) -> int:
    return math.ceil(x - _EPS)


def floor_eps(x: float) -> int:
    return math.floor(x + _EPS)


def round_half_up(x: float) -> int:
    # Python's round() is banker's rounding (round(6.5) == 6); half-up is what readers expect.
    return math.floor(x + 0.5 + _EPS)


def queue_wait_s(pool: PoolSnapshot) -> float | None:
    """The mean over `pool`'s reporting instances of the seconds their queued prompt tokens take
    at each one's measured prefill capacity: the wait a new arrival sees, which stays near zero on
    a near-idle pool (its capacity does not fall with the load) and grows with a backlog, more on
    slow instances. An instance without a measured capacity counts at the pool's mean one. None
    when no instance has measured a capacity (the caller falls back to the served rate)."""
    if pool.instances_reporting == 0 or pool.prefill_measured <= 0 or pool.prefill_capacity_tps <= 0:
        return None
    mean_capacity = pool.prefill_capacity_tps / pool.prefill_measured
    return (pool.prefill_wait_s + pool.unmeasured_prefill_tokens / mean_capacity) / pool.instances_reporting


def _g(x: float | None) -> str:
    """Compact number for reason strings (no commas: reasons end up in a CSV column)."""
    return "none" if x is None else f"{x:.4g}"


# ------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------


@dataclass
class CooldownState:
    """When this policy last decided to scale out and to scale in (seconds, manager clock).

    Two independent timers starting at minus infinity, so the first decision of either kind is
    never blocked and a scale-out does not delay a scale-in. A decision that moves pools both
    ways (a rebalance) sets the timer of its action only.
    """

    last_scale_out_s: float = -math.inf
    last_scale_in_s: float = -math.inf

    def out_ready(self, now_s: float, cooldown_s: float) -> bool:
        return now_s - self.last_scale_out_s >= cooldown_s

    def in_ready(self, now_s: float, cooldown_s: float) -> bool:
        return now_s - self.last_scale_in_s >= cooldown_s

    def record(self, decision: ScaleDecision) -> None:
        if decision.action == "scale_out":
            self.last_scale_out_s = decision.now_s
        elif decision.action == "scale_in":
            self.last_scale_in_s = decision.now_s


@runtime_checkable
class Policy(Protocol):
    """What the manager's control loop and the simulator call once per tick."""

    name: str
    cooldown: CooldownState

    def decide(self, now_s: float, snapshot: ClusterSnapshot) -> ScaleDecision: ...


class _BaseConfig(BaseModel):
    """Bounds and cooldowns every policy has. Names carry units; the docs/algorithms.md spellings
    without units (`scale_out_cooldown`, `tbt_slo`) are accepted as aliases."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    min_instances: int = Field(1, ge=1, description="lower bound of each pool")
    max_instances: int = Field(100, ge=1, description="upper bound of each pool")
    allow_zero_prefill: bool = Field(
        False, description="let the prefill pool shrink to 0 (decode instances then prefill themselves)"
    )
    scale_out_cooldown_s: float = Field(
        180.0,
        ge=0,
        validation_alias=AliasChoices("scale_out_cooldown_s", "scale_out_cooldown"),
        description="seconds after a scale-out before the next scale-out may be decided",
    )
    scale_in_cooldown_s: float = Field(
        600.0,
        ge=0,
        validation_alias=AliasChoices("scale_in_cooldown_s", "scale_in_cooldown"),
        description="seconds after a scale-in before the next scale-in may be decided",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> _BaseConfig:
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances={self.min_instances!r} must be <= max_instances={self.max_instances!r}")
        return self

    def bounds(self, role: Role) -> tuple[int, int]:
        low = 0 if role is Role.PREFILL and self.allow_zero_prefill else self.min_instances
        return low, self.max_instances

    def clamp(self, role: Role, count: int) -> int:
        low, high = self.bounds(role)
        return min(high, max(low, count))


def _roles(snapshot: ClusterSnapshot) -> tuple[Role, ...]:
    return (Role.PREFILL, Role.DECODE) if snapshot.disaggregated else (Role.COLOCATED,)


def _counts(snapshot: ClusterSnapshot) -> dict[Role, int]:
    return {role: snapshot.pool(role).count for role in _roles(snapshot)}


def _make_decision(
    policy: str,
    now_s: float,
    action: ScaleAction,
    reason: str,
    before: Mapping[Role, int],
    after: Mapping[Role, int],
    extra: Mapping[str, float] | None = None,
) -> ScaleDecision:
    if Role.COLOCATED in before:
        return ScaleDecision(
            action=action,
            reason=reason,
            policy=policy,
            now_s=now_s,
            instances_from=before[Role.COLOCATED],
            instances_to=after[Role.COLOCATED],
            extra=dict(extra or {}),
        )
    return ScaleDecision(
        action=action,
        reason=reason,
        policy=policy,
        now_s=now_s,
        prefill_from=before[Role.PREFILL],
        prefill_to=after[Role.PREFILL],
        decode_from=before[Role.DECODE],
        decode_to=after[Role.DECODE],
        extra=dict(extra or {}),
    )


class _PolicyBase:
    """Holds the config and cooldowns; subclasses implement `_rule`."""

    name = "base"

    def __init__(self, config: _BaseConfig) -> None:
        self.config = config
        self.cooldown = CooldownState()

    def decide(self, now_s: float, snapshot: ClusterSnapshot) -> ScaleDecision:
        before = _counts(snapshot)
        repaired = {role: self.config.clamp(role, n) for role, n in before.items()}
        if repaired != before:
            # Bounds are hard limits: they apply at once, whatever the cooldowns say.
            grows = any(repaired[r] > before[r] for r in before)
            low, high = self.config.min_instances, self.config.max_instances
            reason = f"BOUNDS: pool sizes outside [{low}..{high}]"
            decision = _make_decision(self.name, now_s, "scale_out" if grows else "scale_in", reason, before, repaired)
        else:
            decision = self._rule(now_s, snapshot, before)
        self.cooldown.record(decision)
        return decision

    def _rule(self, now_s: float, snapshot: ClusterSnapshot, before: dict[Role, int]) -> ScaleDecision:
        raise NotImplementedError

    def _apply_mixed(
        self,
        now_s: float,
        before: Mapping[Role, int],
        wanted: Mapping[Role, int],
        reason: str,
        extra: Mapping[str, float] | None = None,
    ) -> ScaleDecision:
        """Turn per-pool wishes into a decision, holding back the directions in cooldown.

        Used by rules that judge each pool on its own: a pool may grow only if the scale-out
        timer allows and shrink only if the scale-in timer allows. The action is scale_out if
        any pool grows, else scale_in if any shrinks.
        """
        cfg = self.config
        out_ok = self.cooldown.out_ready(now_s, cfg.scale_out_cooldown_s)
        in_ok = self.cooldown.in_ready(now_s, cfg.scale_in_cooldown_s)
        after: dict[Role, int] = {}
        held: list[str] = []
        for role, cur in before.items():
            want = cfg.clamp(role, wanted[role])
            if want > cur and not out_ok:
                until_s = self.cooldown.last_scale_out_s + cfg.scale_out_cooldown_s
                held.append(f"scale_out cooldown until t={_g(until_s)}")
                want = cur
            elif want < cur and not in_ok:
                until_s = self.cooldown.last_scale_in_s + cfg.scale_in_cooldown_s
                held.append(f"scale_in cooldown until t={_g(until_s)}")
                want = cur
            after[role] = want
        if any(after[r] > before[r] for r in before):
            action: ScaleAction = "scale_out"
        elif any(after[r] < before[r] for r in before):
            action = "scale_in"
        else:
            action = "no_change"
        if held:
            reason = f"{reason}; COOLDOWN: {' and '.join(sorted(set(held)))}"
        return _make_decision(self.name, now_s, action, reason, before, after, extra)


# ------------------------------------------------------------------------------------------
# HeteroScale (default)
# ------------------------------------------------------------------------------------------


class HeteroScaleConfig(_BaseConfig):
    """HeteroScale parameters; defaults are docs/algorithms.md 1's."""

    target_decode_tps_per_instance: float = Field(
        100.0, gt=0, description="decode tokens/s one decode (or colocated) instance should carry"
    )
    pd_ratio: float = Field(0.33, gt=0, le=1, description="prefill instances per decode instance (0.33 = 1:3)")
    scale_out_threshold: float = Field(0.1, ge=0, description="scale out when need/current > 1 + this")
    scale_in_threshold: float = Field(0.1, ge=0, lt=1, description="scale in when need/current < 1 - this")
    enable_latency_trigger: bool = Field(True, description="grow both pools when TBT breaks the panic line")
    tbt_slo_s: float = Field(
        0.1, gt=0, validation_alias=AliasChoices("tbt_slo_s", "tbt_slo"), description="TBT objective, seconds"
    )
    tbt_percentile: Percentile = Field("p50", description="which window TBT percentile the trigger reads")
    latency_panic_threshold: float = Field(1.2, gt=0, description="panic when TBT > tbt_slo_s * this")
    latency_panic_scale_factor: float = Field(
        1.2, ge=1, description="panic grows each pool to max(cur + 1, ceil(cur * this))"
    )
    hold_scale_in_on_panic: bool = Field(
        False,
        description="while TBT is above the panic line, a scale-in is held (no change) instead of falling "
        "through; off by default, as docs/algorithms.md 1 step 3 specifies the fall-through",
    )
    rounding: Literal["ceil", "floor", "round"] = Field(
        "ceil",
        description="ceil/floor: prefill = f(P_exp), decode = prefill * round(1/pd_ratio) (seed formula); "
        "round: each pool rounded half-up on its own (reference simulator)",
    )
    ttft_slo_s: float | None = Field(
        None,
        gt=0,
        description="TTFT objective, seconds; when set, TTFT above ttft_slo_s * latency_panic_threshold "
        "(at ttft_percentile) also triggers the latency panic. A burst shows in TTFT before it shows in "
        "decode TPS, whose window lags the arrivals. Off (None) by default, as in docs/algorithms.md 1",
    )
    ttft_percentile: Percentile = Field("p99", description="which window TTFT percentile the trigger reads")
    target_requests_per_instance: float | None = Field(
        None,
        gt=0,
        description="when set, step 2 also reads concurrency (running + waiting requests, the Knative KPA "
        "signal) and takes need = max(decode_tps / target_decode_tps_per_instance, requests / this): "
        "arrivals queue on the workers at once, while decode TPS rises only as they are served. "
        "Off (None) by default, as in docs/algorithms.md 1",
    )
    queue_target_s: float | None = Field(
        0.5,
        gt=0,
        description="queue-aware trigger: when the prompt tokens queued on the pool that computes prompts would "
        "take longer than this to compute at its prefill rate (queued tokens / prefill TPS: the wait a new "
        "arrival sees), every pool grows at once by that wait / this (at most queue_max_factor), instead of "
        "the latency panic's x latency_panic_scale_factor steps after TTFT has risen. None = off "
        "(docs/algorithms.md 1's HeteroScale as written)",
    )
    queue_max_factor: float = Field(8.0, ge=1, description="the most one queue-aware scale-out multiplies a pool by")
    queue_cooldown_s: float | None = Field(
        2.0,
        ge=0,
        description="the queue-aware trigger may scale out again this long after the last scale-out, instead "
        "of scale_out_cooldown_s (None): a backlog measured at capacity is real work waiting, and the pool "
        "it grew from counts the instances still loading",
    )
    queue_growth: Literal["wait", "drain", "arrivals"] = Field(
        "arrivals",
        description="how far the queue-aware trigger grows the pools. wait: by wait / queue_target_s. drain: "
        "by 1 + wait / queue_target_s, the instances that keep up with what the pool serves (all of it: an "
        "instance with prompts queued prefills at its capacity) plus those that drain the backlog within "
        "the target. arrivals: by max(1, 1 + slope) + (wait + slope * queue_lead_s) / queue_target_s, where "
        "slope is how fast the wait grew over the last queue_slope_window_s (seconds of wait per second): "
        "a saturated pool's wait grows at arrivals / capacity - 1, so 1 + slope keeps up with the arrivals, "
        "and the second term drains, within the target, the backlog there will be once the new instances "
        "have loaded. With the wait not growing it is drain",
    )
    queue_lead_s: float = Field(
        2.0,
        ge=0,
        description="arrivals growth: the seconds a scale-out takes to add capacity (a load), over which the "
        "backlog goes on growing at its slope",
    )
    queue_project_min_s: float | None = Field(
        None,
        ge=0,
        description="arrivals growth: also fire before the wait crosses queue_target_s, when the wait is at least "
        "this many seconds and, projected over queue_lead_s at its slope (wait + slope * queue_lead_s), would be "
        "above the target by the time new instances could load: a burst the serving pool absorbs for a while "
        "shows in the slope before it shows in the wait. The floor keeps start-up ripples (a few queued prompts "
        "on a fresh pool) from firing. None (the default) = off: at 0.125 it cut live8b's p99 TTFT 1.7-3x but "
        "cost hour1000 52% more GPU-seconds (docs/live-scaling.md)",
    )
    queue_slope_window_s: float = Field(
        1.0,
        gt=0,
        description="arrivals growth: the wait's slope is taken between now and the latest wait this policy saw "
        "at least a quarter of this many seconds ago and at most this many (none: no slope). The latest, not the "
        "oldest: a step burst after a calm stretch would read as a fraction of its rate",
    )
    queue_rate: Literal["capacity", "served"] = Field(
        "capacity",
        description="what the queue-aware trigger divides queued prompt tokens by. capacity: each instance's "
        "measured prefill capacity (LoadSample.prefill_capacity_tps, the tokens per second its prefill steps "
        "achieve), so the wait is the one a new arrival sees whatever the load, and a near-idle pool reads as "
        "no wait (`queue_wait_s`); instances that have not measured one yet count at the pool's mean, and a "
        "pool where none has falls back to served. served: the pool's prefill TPS (the demand it served, as "
        "low as the load on a near-idle pool), gated by queue_min_tokens",
    )
    queue_min_tokens: int = Field(
        512,
        ge=0,
        description="with the served rate (queue_rate=served, or no capacity measured yet), the trigger ignores "
        "a backlog of fewer prompt tokens than this: the served rate is as low as the demand on a near-idle "
        "pool, and a few queued prompts would read as a long wait. The capacity rate needs no such floor",
    )
    scale_in_stabilization_s: float = Field(
        0.0,
        ge=0,
        description="a scale-in goes only down to the largest pool size this policy wanted in the last this "
        "many seconds (Kubernetes HPA's downscale stabilization window): a lull inside a burst, or the "
        "lagging decode-TPS window right after a panic scale-out, does not undo the scale-out. 0 = off, "
        "as in docs/algorithms.md 1",
    )
    worker_profile: str | None = Field(
        None,
        description="path of a worker profile (python -m bench.profile writes profiles/<model>.json); when set "
        "and target_decode_tps_per_instance is not, the target is the profile's recommended value, 0.7 x the "
        "decode TPS at which one measured instance saturates. Read once, when the parameters are validated",
    )

    @model_validator(mode="before")
    @classmethod
    def _target_from_profile(cls, data: Any) -> Any:
        # An explicit target wins; the profile only supplies the default.
        if isinstance(data, Mapping) and data.get("worker_profile") and "target_decode_tps_per_instance" not in data:
            profile = load_profile(data["worker_profile"])
            target = profile.recommended.target_decode_tps_per_instance
            return {**data, "target_decode_tps_per_instance": target}
        return data


class HeteroScalePolicy(_PolicyBase):
    """Coordinated P/D scaling on decode TPS with a TBT safety net (docs/algorithms.md 1, steps 1-3).

    Colocated mapping: one pool of N instances, each both prefilling and decoding.
    need = tps / target; ratio = need / N; scale out if ratio > 1 + theta_out, in if
    ratio < 1 - theta_in; desired = rounding(need) (ceil by default), clamped to [min, max].
    The latency panic grows N to max(N + 1, ceil(N * factor)). Cooldowns as in the split case.

    Extensions: a TTFT trigger beside the TBT one (`ttft_slo_s`), concurrency beside decode TPS
    in step 2 (`target_requests_per_instance`), and a scale-in stabilization window
    (`scale_in_stabilization_s`), for which the policy remembers the pool sizes it wanted
    (state besides the cooldown timers, as are the recent queue waits the arrivals growth takes
    a slope from), all off by default; and the queue-aware
    trigger (`queue_target_s`, on by default: it fires only on queued prompt tokens, which the
    docs/algorithms.md vectors do not have, so they hold as written; None turns it off).
    """

    name = "heteroscale"
    config: HeteroScaleConfig

    def __init__(self, config: HeteroScaleConfig | None = None) -> None:
        super().__init__(config or HeteroScaleConfig())
        # (now_s, wanted pool sizes) of recent decisions, oldest first, for the stabilization window.
        self._wanted: deque[tuple[float, dict[Role, int]]] = deque()
        self._wish: dict[Role, int] | None = None  # what the rule wanted before cooldowns and the window
        # (now_s, queued prompts' wait) at recent decisions, oldest first, for the arrivals growth's slope.
        self._waits: deque[tuple[float, float]] = deque()

    def decide(self, now_s: float, snapshot: ClusterSnapshot) -> ScaleDecision:
        self._wish = None
        decision = super().decide(now_s, snapshot)
        window_s = self.config.scale_in_stabilization_s
        if window_s > 0:
            self._wanted.append((now_s, self._wish if self._wish is not None else _targets_of(decision)))
            while self._wanted and self._wanted[0][0] < now_s - window_s:
                self._wanted.popleft()
        return decision

    def _stabilized(self, now_s: float, before: Mapping[Role, int], after: dict[Role, int]) -> dict[Role, int]:
        """`after` with each shrinking pool raised to the largest size wanted within the window."""
        window_s = self.config.scale_in_stabilization_s
        out = dict(after)
        for t_s, wanted in self._wanted:
            if t_s >= now_s - window_s:
                for role, n in wanted.items():
                    if role in out and out[role] < before[role]:
                        out[role] = min(before[role], max(out[role], n))
        return out

    def _queue_wait(self, now_s: float, snapshot: ClusterSnapshot) -> tuple[tuple[float, str] | None, bool]:
        """((growth factor, why) when the queued prompt tokens would wait longer than
        `queue_target_s`, else None; whether that wait is above 0 and growing). (None, False)
        when the trigger is off. The wait is `queue_wait_s`
        (measured capacity) or, with queue_rate=served or no capacity measured, the tokens over
        the served prefill TPS, where none served with tokens queued counts as the largest factor.
        Every call records the wait (0 with nothing queued) for the arrivals growth's slope."""
        cfg = self.config
        if cfg.queue_target_s is None:
            return None, False
        pool = snapshot.prefill if snapshot.disaggregated else snapshot.token_pool
        queued = pool.waiting_prefill_tokens
        wait_s = queue_wait_s(pool) if queued > 0 and cfg.queue_rate == "capacity" else None
        if queued <= 0:
            wait_s = 0.0
        elif wait_s is not None:
            at = f"measured capacities ({pool.prefill_capacity_tps:.0f} tokens/s in all)"
        elif queued < cfg.queue_min_tokens:
            wait_s = 0.0  # too few tokens to judge at the served rate
        else:
            wait_s = queued / pool.prefill_tps if pool.prefill_tps > 0 else math.inf
            at = f"{pool.prefill_tps:.0f} tokens/s"
        slope = self._wait_slope(now_s, wait_s)
        rising = slope > 0 and wait_s > 0
        gain = max(0.0, slope)
        projected_s = wait_s + gain * cfg.queue_lead_s  # the wait once new instances could have loaded
        arrivals = cfg.queue_growth == "arrivals"
        floor_s = cfg.queue_project_min_s
        if wait_s > cfg.queue_target_s:
            why = f"QUEUE: {queued:.0f} prompt tokens queued wait {_g(wait_s)}s at {at} > {_g(cfg.queue_target_s)}s"
            if arrivals and gain > 0:
                why = f"{why}, rising {_g(gain)}s/s"
        elif arrivals and floor_s is not None and wait_s >= floor_s and projected_s > cfg.queue_target_s:
            why = (
                f"QUEUE: {queued:.0f} prompt tokens queued wait {_g(wait_s)}s at {at}, rising {_g(gain)}s/s: "
                f"{_g(projected_s)}s in {_g(cfg.queue_lead_s)}s > {_g(cfg.queue_target_s)}s"
            )
        else:
            return None, rising
        if cfg.queue_growth == "wait":
            growth = wait_s / cfg.queue_target_s
        elif cfg.queue_growth == "drain":
            # Keep up with the pool's load (it is all served at capacity) and drain the backlog.
            growth = 1.0 + wait_s / cfg.queue_target_s
        else:
            # Keep up with the arrivals (a saturated pool's wait grows at arrivals / capacity - 1) and
            # drain, within the target, the backlog there will be when the new instances have loaded.
            growth = 1.0 + gain + projected_s / cfg.queue_target_s
        return (min(cfg.queue_max_factor, growth), why), rising

    def _wait_slope(self, now_s: float, wait_s: float) -> float:
        """Seconds of wait gained per second, from the latest wait recorded at least a quarter of
        `queue_slope_window_s` ago and within it (0 without one) to `wait_s`, which is then
        recorded. An infinite wait (nothing served) is not recorded and has no slope."""
        window_s = self.config.queue_slope_window_s
        while self._waits and self._waits[0][0] < now_s - window_s:
            self._waits.popleft()
        slope = 0.0
        if math.isfinite(wait_s):
            for t0_s, w0_s in reversed(self._waits):  # the latest old enough
                if now_s - t0_s >= window_s / 4:
                    slope = (wait_s - w0_s) / (now_s - t0_s)
                    break
            self._waits.append((now_s, wait_s))
        return slope

    def _latency_panic(self, snapshot: ClusterSnapshot) -> str | None:
        """Why the latency trigger fires now, or None."""
        cfg = self.config
        if not cfg.enable_latency_trigger:
            return None
        pool = snapshot.token_pool
        tbt_s = pool.tbt_s(cfg.tbt_percentile)
        tbt_line_s = cfg.tbt_slo_s * cfg.latency_panic_threshold
        if tbt_s is not None and tbt_s > tbt_line_s:
            return f"LATENCY_PANIC: tbt={_g(tbt_s)}s > {_g(tbt_line_s)}s"
        if cfg.ttft_slo_s is not None:
            ttft_s = pool.ttft_p99_s if cfg.ttft_percentile == "p99" else pool.ttft_p50_s
            ttft_line_s = cfg.ttft_slo_s * cfg.latency_panic_threshold
            if ttft_s is not None and ttft_s > ttft_line_s:
                return f"LATENCY_PANIC: ttft_{cfg.ttft_percentile}={_g(ttft_s)}s > {_g(ttft_line_s)}s"
        return None

    def _rule(self, now_s: float, snapshot: ClusterSnapshot, before: dict[Role, int]) -> ScaleDecision:
        cfg = self.config
        tbt_s = snapshot.token_pool.tbt_s(cfg.tbt_percentile)
        out_ok = self.cooldown.out_ready(now_s, cfg.scale_out_cooldown_s)
        in_ok = self.cooldown.in_ready(now_s, cfg.scale_in_cooldown_s)
        out_until_s = self.cooldown.last_scale_out_s + cfg.scale_out_cooldown_s
        in_until_s = self.cooldown.last_scale_in_s + cfg.scale_in_cooldown_s

        # Step 0 (queue_target_s): the queue-aware trigger grows every pool by how far the queued
        # prompts' wait is over the target, in one step. Blocked by the cooldown, it goes on.
        note = ""
        queue, queue_rising = self._queue_wait(now_s, snapshot)
        if queue is not None:
            factor, why = queue
            queue_cooldown_s = cfg.scale_out_cooldown_s if cfg.queue_cooldown_s is None else cfg.queue_cooldown_s
            if self.cooldown.out_ready(now_s, queue_cooldown_s):
                after = {r: cfg.clamp(r, max(n + 1, ceil_eps(n * factor))) for r, n in before.items()}
                if after != before:
                    extra = {"queue_factor": factor} | ({"tbt_s": tbt_s} if tbt_s is not None else {})
                    return _make_decision(self.name, now_s, "scale_out", why, before, after, extra)
                note = f"{why} but every pool is at max_instances={cfg.max_instances}; "
            else:
                until_s = self.cooldown.last_scale_out_s + queue_cooldown_s
                note = f"{why} held by scale_out cooldown until t={_g(until_s)}; "

        # Step 1: latency panic. Blocked by the scale-out cooldown, it falls through to step 2.
        panic_reason = self._latency_panic(snapshot)
        panicking = panic_reason is not None
        if panic_reason is not None:
            if out_ok:
                factor = cfg.latency_panic_scale_factor
                after = {r: cfg.clamp(r, max(n + 1, ceil_eps(n * factor))) for r, n in before.items()}
                if after != before:
                    return _make_decision(
                        self.name,
                        now_s,
                        "scale_out",
                        panic_reason,
                        before,
                        after,
                        {"tbt_s": tbt_s} if tbt_s is not None else {},
                    )
                note = f"{note}{panic_reason} but every pool is at max_instances={cfg.max_instances}; "
            else:
                note = f"{note}{panic_reason} held by scale_out cooldown until t={_g(out_until_s)}; "

        # Step 2: proportional control on decode TPS (and, optionally, on concurrency).
        tps = snapshot.decode_tps
        need = tps / cfg.target_decode_tps_per_instance
        current = sum(before.values())
        extra = {"decode_tps": tps}
        facts = f"decode_tps={_g(tps)}"
        if cfg.target_requests_per_instance is not None:
            pool = snapshot.token_pool
            requests = pool.running + pool.waiting
            if snapshot.disaggregated:
                requests += snapshot.prefill.waiting  # queued prompts are demand for both pools
            need = max(need, requests / cfg.target_requests_per_instance)
            extra["requests"] = requests
            facts = f"{facts} requests={_g(requests)}"
        ratio = need / current if current > 0 else math.inf
        extra.update({"need": need, "ratio": ratio})
        facts = f"need={_g(need)} {facts}"
        hi_line, lo_line = 1 + cfg.scale_out_threshold, 1 - cfg.scale_in_threshold
        if ratio > hi_line:
            action: ScaleAction = "scale_out"
            reason = f"{note}SCALE_OUT: ratio={_g(ratio)} > {_g(hi_line)} {facts}"
            allowed, until_s = out_ok, out_until_s
        elif ratio < lo_line:
            action = "scale_in"
            reason = f"{note}SCALE_IN: ratio={_g(ratio)} < {_g(lo_line)} {facts}"
            allowed, until_s = in_ok, in_until_s
        else:
            reason = f"{note}IN_BAND: ratio={_g(ratio)} within {_g(lo_line)}..{_g(hi_line)} {facts}"
            return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)

        if not allowed:
            self._wish = self._targets(need, snapshot.disaggregated)
            reason = f"{reason}; COOLDOWN: {action} held until t={_g(until_s)}"
            return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)
        if action == "scale_in" and cfg.hold_scale_in_on_panic and (panicking or queue is not None):
            # Low decode TPS under high TBT means requests are stuck, not that load is gone.
            reason = f"{reason}; HELD: no scale-in while latency is above the panic line"
            return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)
        if action == "scale_in" and cfg.hold_scale_in_on_panic and queue_rising:
            # Prompts queue faster than they are computed: a burst may be starting, which the
            # decode-TPS window has not seen yet. Held for this tick only: the stabilization window
            # records the smaller pool the rule wanted, not the current one (which would hold
            # every scale-in for a whole window after each such tick).
            self._wish = self._targets(need, snapshot.disaggregated)
            reason = f"{reason}; HELD: no scale-in while the queued prompts' wait grows"
            return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)
        after = self._targets(need, snapshot.disaggregated)
        # A scale-in never grows a pool and a scale-out never shrinks one: split by pd_ratio, a
        # small need can ask for more decode instances than a 1:1 deployment has (1 prefill ->
        # 3 decode at 1:3), and a scale-out for fewer prefill instances than are serving.
        keep = min if action == "scale_in" else max
        after = {role: keep(n, before.get(role, n)) for role, n in after.items()}
        self._wish = after
        if after == before:
            # Rounding (ceil of need) or the [min, max] clamp lands on the current sizes.
            reason = f"{reason}; AT_TARGET: the rounded, clamped target {_sizes(after)} is the current size"
            return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)
        if action == "scale_in" and cfg.scale_in_stabilization_s > 0:
            held_at = self._stabilized(now_s, before, after)
            if held_at != after:
                window = f"STABILIZED: wanted up to {_sizes(held_at)} in the last {_g(cfg.scale_in_stabilization_s)}s"
                reason = f"{reason}; {window}"
                after = held_at
                if after == before:
                    return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)
        return _make_decision(self.name, now_s, action, reason, before, after, extra)

    def _targets(self, need: float, disaggregated: bool) -> dict[Role, int]:
        cfg = self.config
        if not disaggregated:
            rounder = {"ceil": ceil_eps, "floor": floor_eps, "round": round_half_up}[cfg.rounding]
            return {Role.COLOCATED: cfg.clamp(Role.COLOCATED, rounder(need))}
        parts = 1 + 1 / cfg.pd_ratio
        p_exp = need / parts
        d_exp = p_exp / cfg.pd_ratio
        if cfg.rounding == "round":
            prefill, decode = round_half_up(p_exp), round_half_up(d_exp)
        else:
            prefill = ceil_eps(p_exp) if cfg.rounding == "ceil" else floor_eps(p_exp)
            # pd_ratio <= 1 is validated, so the multiplier is at least 1.
            decode = prefill * round_half_up(1 / cfg.pd_ratio)
        return {Role.PREFILL: cfg.clamp(Role.PREFILL, prefill), Role.DECODE: cfg.clamp(Role.DECODE, decode)}


def _targets_of(decision: ScaleDecision) -> dict[Role, int]:
    """The pool sizes a decision asks for (its current sizes for no_change)."""
    if decision.is_colocated:
        return {Role.COLOCATED: decision.instances_to or 0}
    return {Role.PREFILL: decision.prefill_to or 0, Role.DECODE: decision.decode_to or 0}


def _sizes(pools: Mapping[Role, int]) -> str:
    return "/".join(f"{role.value.lower()}={n}" for role, n in pools.items())


# ------------------------------------------------------------------------------------------
# Utilization (Kubernetes HPA style)
# ------------------------------------------------------------------------------------------


class UtilizationConfig(_BaseConfig):
    """HPA-style rule. Cooldown defaults are HPA's: scale up at once, 300 s before scaling down."""

    scale_out_cooldown_s: float = Field(
        0.0,
        ge=0,
        validation_alias=AliasChoices("scale_out_cooldown_s", "scale_out_cooldown"),
        description="seconds after a scale-out before the next scale-out may be decided",
    )
    scale_in_cooldown_s: float = Field(
        300.0,
        ge=0,
        validation_alias=AliasChoices("scale_in_cooldown_s", "scale_in_cooldown"),
        description="seconds after a scale-in before the next scale-in may be decided",
    )
    target_utilization: float = Field(0.7, gt=0, le=1, description="utilization each pool is sized for")
    scale_out_ratio: float = Field(1.1, ge=1, description="scale out if any pool's util/target exceeds this")
    scale_in_ratio: float = Field(
        0.9, gt=0, le=1, description="scale in only if every pool's util/target is below this"
    )
    prefill_metric: Literal["kv", "tps"] = Field(
        "tps", description="prefill pool utilization: KV use, or prefill TPS / capacity"
    )
    decode_metric: Literal["kv", "tps"] = Field(
        "kv", description="decode pool utilization: KV use, or decode TPS / capacity"
    )
    colocated_metric: Literal["kv", "tps"] = Field("kv", description="colocated pool utilization")
    prefill_capacity_tps_per_instance: float = Field(
        10000.0, gt=0, description="prefill tokens/s one instance sustains (tps metric)"
    )
    decode_capacity_tps_per_instance: float = Field(
        100.0, gt=0, description="decode tokens/s one instance sustains (tps metric)"
    )


class UtilizationPolicy(_PolicyBase):
    """Each pool wants ceil(reporting * util / target); out if any pool's util/target > 1.1,
    in only if all are < 0.9 (docs/algorithms.md 1, other policies).

    Utilization is measured on the instances that reported in the window, and the wish is
    compared with the pool count that includes LOADING ones: capacity already on its way is not
    ordered again while it loads. "tps" utilization is TPS / (reporting * capacity per instance);
    "kv" is KV blocks used / total. Colocated: the one pool with `colocated_metric`.
    """

    name = "utilization"
    config: UtilizationConfig

    def __init__(self, config: UtilizationConfig | None = None) -> None:
        super().__init__(config or UtilizationConfig())

    def _utilization(self, pool: PoolSnapshot) -> tuple[float, int] | None:
        cfg = self.config
        metric = {
            Role.PREFILL: cfg.prefill_metric,
            Role.DECODE: cfg.decode_metric,
            Role.COLOCATED: cfg.colocated_metric,
        }[pool.role]
        base = pool.instances_reporting
        if base == 0:
            return None
        if metric == "kv":
            util = pool.kv_utilization
            return None if util is None else (util, base)
        if pool.role is Role.PREFILL:
            return pool.prefill_tps / (base * cfg.prefill_capacity_tps_per_instance), base
        return pool.decode_tps / (base * cfg.decode_capacity_tps_per_instance), base

    def _rule(self, now_s: float, snapshot: ClusterSnapshot, before: dict[Role, int]) -> ScaleDecision:
        cfg = self.config
        measured = {role: self._utilization(snapshot.pool(role)) for role in before}
        ratios = {role: (m[0] / cfg.target_utilization if m else None) for role, m in measured.items()}
        facts = " ".join(f"{role.value.lower()}_ratio={_g(r)}" for role, r in ratios.items())
        extra = {f"{role.value.lower()}_ratio": r for role, r in ratios.items() if r is not None}

        def wish(role: Role) -> int:
            m, r = measured[role], ratios[role]
            assert m is not None and r is not None
            return ceil_eps(m[1] * r)

        hot = [role for role, r in ratios.items() if r is not None and r > cfg.scale_out_ratio]
        if hot:
            wanted = {role: max(before[role], wish(role)) if role in hot else before[role] for role in before}
            return self._apply_mixed(now_s, before, wanted, f"UTIL_HIGH: {facts} > {_g(cfg.scale_out_ratio)}", extra)
        if all(r is not None and r < cfg.scale_in_ratio for r in ratios.values()):
            wanted = {role: min(before[role], wish(role)) for role in before}
            return self._apply_mixed(now_s, before, wanted, f"UTIL_LOW: {facts} < {_g(cfg.scale_in_ratio)}", extra)
        reason = f"IN_BAND: {facts}" if all(r is not None for r in ratios.values()) else f"NO_DATA: {facts}"
        return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)


# ------------------------------------------------------------------------------------------
# Latency
# ------------------------------------------------------------------------------------------


class LatencyConfig(_BaseConfig):
    """Step rule on TBT; cooldowns default to HeteroScale's so the two compare on the rule alone."""

    tbt_slo_s: float = Field(
        0.1, gt=0, validation_alias=AliasChoices("tbt_slo_s", "tbt_slo"), description="TBT objective, seconds"
    )
    tbt_percentile: Percentile = Field("p50", description="which window TBT percentile is compared")
    scale_out_above: float = Field(1.1, gt=0, description="add instances when TBT > tbt_slo_s * this")
    scale_in_below: float = Field(0.8, gt=0, description="remove instances when TBT < tbt_slo_s * this")
    step_out: int = Field(2, ge=1, description="instances added per pool")
    step_in: int = Field(1, ge=1, description="instances removed per pool")

    @model_validator(mode="after")
    def _check_band(self) -> LatencyConfig:
        if self.scale_in_below >= self.scale_out_above:
            raise ValueError(
                f"scale_in_below={self.scale_in_below!r} must be < scale_out_above={self.scale_out_above!r}"
            )
        return self


class LatencyPolicy(_PolicyBase):
    """TBT > 1.1 SLO adds 2 to each pool, TBT < 0.8 SLO removes 1 from each pool.

    TBT is the token pool's (decode, or colocated). Colocated: the one pool moves by the steps.
    No TBT in the window (no traffic) is not evidence of slack, so it changes nothing.
    """

    name = "latency"
    config: LatencyConfig

    def __init__(self, config: LatencyConfig | None = None) -> None:
        super().__init__(config or LatencyConfig())

    def _rule(self, now_s: float, snapshot: ClusterSnapshot, before: dict[Role, int]) -> ScaleDecision:
        cfg = self.config
        tbt_s = snapshot.token_pool.tbt_s(cfg.tbt_percentile)
        high_s, low_s = cfg.tbt_slo_s * cfg.scale_out_above, cfg.tbt_slo_s * cfg.scale_in_below
        extra = {} if tbt_s is None else {"tbt_s": tbt_s}
        if tbt_s is not None and tbt_s > high_s:
            wanted = {role: n + cfg.step_out for role, n in before.items()}
            return self._apply_mixed(now_s, before, wanted, f"TBT_HIGH: tbt={_g(tbt_s)}s > {_g(high_s)}s", extra)
        if tbt_s is not None and tbt_s < low_s:
            wanted = {role: n - cfg.step_in for role, n in before.items()}
            return self._apply_mixed(now_s, before, wanted, f"TBT_LOW: tbt={_g(tbt_s)}s < {_g(low_s)}s", extra)
        reason = (
            "NO_DATA: no TBT in window"
            if tbt_s is None
            else (f"IN_BAND: tbt={_g(tbt_s)}s within {_g(low_s)}..{_g(high_s)}s")
        )
        return _make_decision(self.name, now_s, "no_change", reason, before, before, extra)


# ------------------------------------------------------------------------------------------
# Periodic
# ------------------------------------------------------------------------------------------

_HHMM = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")


class ScheduleEntry(BaseModel):
    """From `at_s` seconds into the period (or "HH:MM[:SS]") until the next entry, these sizes."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    at_s: float = Field(validation_alias=AliasChoices("at_s", "at"), ge=0, description="start, seconds into the period")
    prefill: int | None = Field(None, ge=0, description="prefill pool size (split deployments)")
    decode: int | None = Field(None, ge=0, description="decode pool size (split deployments)")
    instances: int | None = Field(None, ge=0, description="pool size (colocated deployments)")

    @field_validator("at_s", mode="before")
    @classmethod
    def _parse_clock(cls, value: Any) -> Any:
        if isinstance(value, str):
            match = _HHMM.match(value.strip())
            if not match:
                raise ValueError(f"schedule time {value!r} is not HH:MM or HH:MM:SS")
            hours, minutes, seconds = (int(g or 0) for g in match.groups())
            if hours > 23 or minutes > 59 or seconds > 59:
                raise ValueError(f"schedule time {value!r} is not a valid time of day")
            return hours * 3600 + minutes * 60 + seconds
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> ScheduleEntry:
        split = self.prefill is not None and self.decode is not None
        single = self.instances is not None
        if split == single or (not split and (self.prefill is not None or self.decode is not None)):
            raise ValueError(
                "schedule entry needs prefill and decode (split) or instances (colocated), got "
                f"prefill={self.prefill!r} decode={self.decode!r} instances={self.instances!r}"
            )
        return self


class PeriodicConfig(_BaseConfig):
    """A daily (or `period_s`) schedule; sizes still pass through [min, max] and cooldowns."""

    scale_out_cooldown_s: float = Field(
        0.0,
        ge=0,
        validation_alias=AliasChoices("scale_out_cooldown_s", "scale_out_cooldown"),
        description="seconds after a scale-out before the next scale-out may be decided",
    )
    scale_in_cooldown_s: float = Field(
        0.0,
        ge=0,
        validation_alias=AliasChoices("scale_in_cooldown_s", "scale_in_cooldown"),
        description="seconds after a scale-in before the next scale-in may be decided",
    )
    schedule: tuple[ScheduleEntry, ...] = Field(min_length=1, description="entries, any order")
    period_s: float = Field(86400.0, gt=0, description="length of the cycle (a day; shorter in simulations)")
    period_start_s: float = Field(0.0, description="the now_s at which a period starts (midnight)")

    @model_validator(mode="after")
    def _check_schedule(self) -> PeriodicConfig:
        starts = [e.at_s for e in self.schedule]
        if len(set(starts)) != len(starts):
            raise ValueError(f"schedule has two entries starting at the same time: {sorted(starts)!r}")
        if max(starts) >= self.period_s:
            raise ValueError(f"schedule entry at_s={max(starts)!r} is not inside period_s={self.period_s!r}")
        kinds = {e.instances is None for e in self.schedule}
        if len(kinds) > 1:
            raise ValueError("schedule mixes split (prefill/decode) and colocated (instances) entries")
        return self

    @field_validator("schedule", mode="after")
    @classmethod
    def _sort_schedule(cls, schedule: tuple[ScheduleEntry, ...]) -> tuple[ScheduleEntry, ...]:
        # Sorted once here so entry_at() can stop at the first later start.
        return tuple(sorted(schedule, key=lambda e: e.at_s))


class PeriodicPolicy(_PolicyBase):
    """Pool sizes by time of day: the entry in force is the last one starting at or before the
    current point of the period, wrapping to the last entry before the first start.

    Colocated deployments use `instances` entries; a schedule of the other kind changes nothing
    and says so in the reason.
    """

    name = "periodic"
    config: PeriodicConfig

    def __init__(self, config: PeriodicConfig) -> None:
        super().__init__(config)

    def entry_at(self, now_s: float) -> ScheduleEntry:
        cfg = self.config
        offset_s = (now_s - cfg.period_start_s) % cfg.period_s
        current = cfg.schedule[-1]
        for entry in cfg.schedule:
            if entry.at_s <= offset_s:
                current = entry
            else:
                break
        return current

    def _rule(self, now_s: float, snapshot: ClusterSnapshot, before: dict[Role, int]) -> ScaleDecision:
        entry = self.entry_at(now_s)
        whole_s = int(entry.at_s)
        at = f"{whole_s // 3600:02d}:{whole_s // 60 % 60:02d}:{whole_s % 60:02d}"
        if snapshot.disaggregated != (entry.instances is None):
            kind = "split" if snapshot.disaggregated else "colocated"
            reason = f"SCHEDULE_MISMATCH: deployment is {kind} but the schedule is not"
            return _make_decision(self.name, now_s, "no_change", reason, before, before)
        if entry.instances is not None:
            wanted = {Role.COLOCATED: entry.instances}
            reason = f"SCHEDULE: entry at {at} wants instances={entry.instances}"
        else:
            assert entry.prefill is not None and entry.decode is not None
            wanted = {Role.PREFILL: entry.prefill, Role.DECODE: entry.decode}
            reason = f"SCHEDULE: entry at {at} wants prompt={entry.prefill} token={entry.decode}"
        return self._apply_mixed(now_s, before, wanted, reason)


# ------------------------------------------------------------------------------------------
# BlitzScale bounds
# ------------------------------------------------------------------------------------------


class BlitzScaleBoundsConfig(_BaseConfig):
    """Keep KV use and queued prefill work inside bands. Cooldowns default to 0: growth targets
    an absolute size (idempotent while instances load) and shrinking is one per step."""

    scale_out_cooldown_s: float = Field(
        0.0,
        ge=0,
        validation_alias=AliasChoices("scale_out_cooldown_s", "scale_out_cooldown"),
        description="seconds after a scale-out before the next scale-out may be decided",
    )
    scale_in_cooldown_s: float = Field(
        0.0,
        ge=0,
        validation_alias=AliasChoices("scale_in_cooldown_s", "scale_in_cooldown"),
        description="seconds after a scale-in before the next scale-in may be decided",
    )
    kv_low: float = Field(0.75, gt=0, lt=1, description="decode KV use below this removes one replica")
    kv_high: float = Field(0.95, gt=0, le=1, description="decode KV use above this grows to the band middle")
    prefill_low: float = Field(0.5, gt=0, description="prefill load below this removes one replica")
    prefill_high: float = Field(0.8, gt=0, description="prefill load above this grows to the band middle")
    kv_blocks_per_replica: int | None = Field(
        None, ge=1, description="KV blocks of one replica; None infers it from the window's reports"
    )
    prefill_tps_per_replica: float = Field(
        10000.0, gt=0, description="prefill tokens/s one replica sustains (measure it for your model)"
    )

    @model_validator(mode="after")
    def _check_bands(self) -> BlitzScaleBoundsConfig:
        if self.kv_low >= self.kv_high:
            raise ValueError(f"kv_low={self.kv_low!r} must be < kv_high={self.kv_high!r}")
        if self.prefill_low >= self.prefill_high:
            raise ValueError(f"prefill_low={self.prefill_low!r} must be < prefill_high={self.prefill_high!r}")
        return self


class BlitzScaleBoundsPolicy(_PolicyBase):
    """BlitzScale's bounds (docs/algorithms.md 1, other policies).

    Decode: util = KV blocks used / (D * blocks per replica). Above kv_high, D grows to
    ceil(used / (blocks per replica * band middle)); below kv_low, D drops by one.
    Prefill: load = waiting prefill tokens / (P * prefill tokens/s per replica) (seconds of queued
    work per replica). Above prefill_high, P grows to ceil(waiting / (tps * middle)); below
    prefill_low, P drops by one. Never below one (or the configured minimum).
    We also refuse a one-step shrink that would land above the upper bound, which would only
    bounce back on the next tick.
    Colocated: both rules judge the one pool; it grows to the larger wish and shrinks only if
    both rules want it smaller.
    """

    name = "blitzscale_bounds"
    config: BlitzScaleBoundsConfig

    def __init__(self, config: BlitzScaleBoundsConfig | None = None) -> None:
        super().__init__(config or BlitzScaleBoundsConfig())

    def _kv_wish(self, pool: PoolSnapshot, cur: int) -> tuple[int, str] | None:
        cfg = self.config
        per_replica = cfg.kv_blocks_per_replica or pool.kv_blocks_per_instance
        if per_replica is None or cur == 0:
            return None
        used = pool.kv_blocks_used
        util = used / (cur * per_replica)
        middle = (cfg.kv_low + cfg.kv_high) / 2
        fact = f"kv={_g(util)}"
        if util > cfg.kv_high:
            return max(cur, ceil_eps(used / (per_replica * middle))), f"{fact} > {_g(cfg.kv_high)}"
        if util < cfg.kv_low and cur > 1 and used / ((cur - 1) * per_replica) <= cfg.kv_high:
            return cur - 1, f"{fact} < {_g(cfg.kv_low)}"
        return cur, fact

    def _prefill_wish(self, pool: PoolSnapshot, cur: int) -> tuple[int, str] | None:
        cfg = self.config
        if cur == 0:
            return None
        waiting = pool.waiting_prefill_tokens
        per_replica = cfg.prefill_tps_per_replica
        load = waiting / (cur * per_replica)
        middle = (cfg.prefill_low + cfg.prefill_high) / 2
        fact = f"prefill_load={_g(load)}"
        if load > cfg.prefill_high:
            return max(cur, ceil_eps(waiting / (per_replica * middle))), f"{fact} > {_g(cfg.prefill_high)}"
        if load < cfg.prefill_low and cur > 1 and waiting / ((cur - 1) * per_replica) <= cfg.prefill_high:
            return cur - 1, f"{fact} < {_g(cfg.prefill_low)}"
        return cur, fact

    def _rule(self, now_s: float, snapshot: ClusterSnapshot, before: dict[Role, int]) -> ScaleDecision:
        wanted = dict(before)
        facts: list[str] = []
        if snapshot.disaggregated:
            for role, judge in ((Role.DECODE, self._kv_wish), (Role.PREFILL, self._prefill_wish)):
                wish = judge(snapshot.pool(role), before[role])
                if wish is None:
                    facts.append(f"{role.value.lower()}: no data")
                else:
                    wanted[role] = wish[0]
                    facts.append(wish[1])
        else:
            pool, cur = snapshot.colocated, before[Role.COLOCATED]
            wishes = [w for w in (self._kv_wish(pool, cur), self._prefill_wish(pool, cur)) if w is not None]
            facts = [w[1] for w in wishes] or ["no data"]
            if any(w[0] > cur for w in wishes):
                wanted[Role.COLOCATED] = max(w[0] for w in wishes)
            elif wishes and all(w[0] < cur for w in wishes):
                wanted[Role.COLOCATED] = cur - 1
        reason = f"BOUNDS_RULE: {' '.join(facts)}"
        return self._apply_mixed(now_s, before, wanted, reason)


# ------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------

_POLICIES: dict[str, tuple[type[_BaseConfig], Callable[[Any], _PolicyBase]]] = {
    HeteroScalePolicy.name: (HeteroScaleConfig, HeteroScalePolicy),
    UtilizationPolicy.name: (UtilizationConfig, UtilizationPolicy),
    LatencyPolicy.name: (LatencyConfig, LatencyPolicy),
    PeriodicPolicy.name: (PeriodicConfig, PeriodicPolicy),
    BlitzScaleBoundsPolicy.name: (BlitzScaleBoundsConfig, BlitzScaleBoundsPolicy),
}


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Build a policy by name from plain parameters (a config file section or an Admin RPC).

    Raises ValueError naming the policy and quoting every bad parameter and value.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in _POLICIES:
        raise ValueError(f"unknown autoscaling policy {name!r}; known: {', '.join(policy_names())}")
    config_cls, policy_cls = _POLICIES[key]
    try:
        config = config_cls.model_validate(dict(params or {}))
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(params)'}: {e['msg'].removeprefix('Value error, ')}"
            + ("" if not e["loc"] else f" (got {e.get('input')!r})")
            for e in err.errors()
        )
        raise ValueError(f"invalid parameters for policy {key!r}: {problems}") from err
    policy: Policy = policy_cls(config)
    return policy
