"""Global manager configuration."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from services.common.config import ServiceConfig
from services.global_manager.core.policies import make_policy
from services.global_manager.core.reconcile import KEEP_WARM_MAX_S
from services.global_manager.core.routing import BorrowPrefill
from services.global_manager.core.types import Role
from services.global_manager.core.zigzag import ZigzagSettings

ZIGZAG_DEFAULTS = ZigzagSettings()
BORROW_DEFAULTS = BorrowPrefill()


class GlobalManagerConfig(ServiceConfig):
    param_manager: str = Field("", description="parameter manager address (model catalogue, locations)")
    default_model: str = Field("", description="model kept at min_instances from the idle pool (and autoscaled)")
    min_instances: int = Field(
        0, ge=0, description="colocated instances of default_model kept loaded (0 with min_prefill/min_decode)"
    )
    min_prefill: int = Field(
        0,
        ge=0,
        description="prefill instances of default_model kept loaded: with min_decode > 0 the model is served "
        "disaggregated (prompt on a prefill instance, then its KV to a decode instance); 0 = colocated",
    )
    min_decode: int = Field(
        0, ge=0, description="decode instances of default_model kept loaded; set with min_prefill, or neither"
    )
    kv_block_size_tokens: int = Field(
        16,
        gt=0,
        description="tokens per KV block on the workers (their --block-size): routing prefers instances whose "
        "free blocks hold the request (the prompt on a prefill instance, prompt + max_tokens elsewhere)",
    )
    max_instances: int = Field(100, ge=1, description="upper bound for any scale-out")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="period workers are told to heartbeat at")
    lost_after_s: float = Field(5.0, gt=0, description="an instance silent this long is LOST")
    probe_timeout_s: float = Field(
        1.0,
        gt=0,
        description="how long the manager waits for a suspect instance (one a gateway reported failed) to answer "
        "its status probe; refused: LOST at once; no answer: suspect until it heartbeats again or goes LOST",
    )
    window_s: float = Field(10.0, gt=0, description="load monitor window")
    tick_s: float = Field(0.5, gt=0, description="period of the control loop")
    load_timeout_s: float = Field(300.0, gt=0, description="a parameter load that takes longer fails")
    load_retries: int = Field(
        1, ge=0, description="a failed scale-out load is retried on this many other IDLE workers, then rolled back"
    )
    drain_timeout_s: float = Field(60.0, gt=0, description="in-flight requests get this long on scale-in")
    transfer_plans: bool = Field(
        True,
        description="plan multicast chains from live instances and host shards for a scale-out; off: every new "
        "instance pulls from the host caches alone (the ServerlessLLM baseline of bench.live_scaling)",
    )
    live_migration: bool = Field(
        True,
        description="move running requests with their KV off an instance over its KV or TBT target to the "
        "least-loaded one of its pool (Worker.ReleaseRunning; the gateway resumes each, pulling the KV)",
    )
    migration_kv_high: float = Field(
        0.95, gt=0, le=1, description="live migration: an instance using more of its KV blocks than this sheds requests"
    )
    migration_tbt_slo_s: float | None = Field(
        None, gt=0, description="live migration: an instance whose TBT p99 exceeds this sheds requests (None = off)"
    )
    migration_cooldown_s: float = Field(
        5.0, gt=0, description="live migration: least time between moves off one instance"
    )
    keep_warm_max_s: float = Field(
        KEEP_WARM_MAX_S,
        ge=0,
        description="a drained instance keeps the weights for as long as its model's last load took, at most this "
        "long, so a scale-out that reverses a scale-in within it costs no transfer; the instance is IDLE meanwhile "
        "and any load of another model frees them (0 = unload at once)",
    )
    esp: bool = Field(
        True,
        description="elastic sequence parallelism (LoongServe): a request whose prompt + max_tokens no single SERVING "
        "instance's KV holds is routed to a group of instances that prefill it together and decode from the KV "
        "where it was computed (docs/esp.md)",
    )
    esp_min_prompt_tokens: int = Field(
        0,
        ge=0,
        description="also route prompts of at least this many tokens to an ESP group (0: only those no instance holds)",
    )
    zigzag: bool = Field(
        True,
        description="ZigZag live scaling: a LOADING instance holding >= 1 decoder layer runs the first layers of "
        "prompts an overloaded SERVING instance (its partner) finishes; how the work reaches it: zigzag_dispatch",
    )
    zigzag_live: str = Field(
        ZIGZAG_DEFAULTS.live,
        pattern="^(all|tails)$",
        description="which LOADING instances serve ZigZag requests: 'all' (every target of a scale-out, from its "
        "first layer) or 'tails' (only the last target of each transfer chain, as BlitzScale picks)",
    )
    zigzag_ttft_s: float | None = Field(
        ZIGZAG_DEFAULTS.ttft_s,
        gt=0,
        description="ZigZag's gate also opens when every SERVING instance's TTFT p50 is at least this (prefill work "
        "crowds its steps even with no request waiting: a split takes the first layers of prompts off it); "
        "None = only requests waiting open it",
    )
    zigzag_dispatch: str = Field(
        ZIGZAG_DEFAULTS.dispatch,
        pattern="^(route|pull)$",
        description="how ZigZag work reaches a LOADING instance: 'route' (Schedule sends a new request to it and its "
        "partner, two hops) or 'pull' (as BlitzScale's NewPrefill: each live LOADING instance is paired with a SERVING "
        "one, which hands it the requests at the head of its own queue to run ahead and takes them over when it "
        "admits them)",
    )
    zigzag_pull_limit: int = Field(
        ZIGZAG_DEFAULTS.pull_limit,
        ge=0,
        description="with zigzag_dispatch 'pull', the most queued requests one LOADING instance runs ahead at once "
        "(0: the routed cap, 4 shrinking to 2 as BlitzScale's; a partner admits a step's worth of prompts at once)",
    )
    zigzag_stall_s: float = Field(
        ZIGZAG_DEFAULTS.stall_s,
        gt=0,
        description="a LOADING instance whose layer count has not grown for this long gets no ZigZag work",
    )
    zigzag_hand_back: bool = Field(
        ZIGZAG_DEFAULTS.hand_back,
        description="when a ZigZag-serving instance finishes loading, its partner's running requests above an even "
        "share of the two move to it by live migration, with their KV",
    )
    zigzag_hand_back_min_tokens_left: int = Field(
        ZIGZAG_DEFAULTS.hand_back_min_tokens_left,
        ge=0,
        description="hand-back moves only running requests with at least this many tokens left to generate (a move "
        "costs a new route and a KV pull; 0: any)",
    )
    zigzag_hand_back_wait_s: float = Field(
        ZIGZAG_DEFAULTS.hand_back_wait_s,
        ge=0,
        allow_inf_nan=False,
        description="a hand-back waits while the partner's link carries parameters to a load (its KV would share "
        "the link with the chain), at most this many seconds (0: never waits)",
    )
    borrow_prefill: bool = Field(
        True,
        description="borrowed prefill (TokenScale), split deployments: while every SERVING prefill instance's queued "
        "prompt tokens take longer than borrow_prefill_wait_s at its measured prefill capacity, a new request runs "
        "whole (prompt and decode, no KV transfer) on a decode instance holding fewer than "
        "borrow_prefill_max_decode_requests requests whose own prompt queue is shorter",
    )
    borrow_prefill_wait_s: float = Field(
        BORROW_DEFAULTS.wait_s,
        ge=0,
        description="borrowed prefill: the prefill pool's backlog (seconds of queued prompt tokens on its least "
        "backlogged instance) above which a decode instance may take a request (the queue trigger's own target)",
    )
    borrow_prefill_max_decode_requests: int = Field(
        BORROW_DEFAULTS.max_decode_requests,
        ge=1,
        description="borrowed prefill: a decode instance lends only while it holds fewer requests than this",
    )
    rebalance: bool = Field(
        True,
        description="when an instance becomes SERVING, busier instances of its pool release queued (not yet "
        "started) requests above an even share, and the gateway re-routes them to it",
    )
    topology: dict[str, Any] | None = Field(
        None,
        description='hosts and links for the multicast planner, e.g. {"hosts": {"h0": {"leaf": "l0", "bw_gbps": 100}}, '
        '"fast_groups": [["h0", "h1"]]}; hosts it does not name share one leaf',
    )
    policy: str = Field("heteroscale", description="autoscaling policy name")
    policy_params: dict[str, Any] = Field(
        default_factory=dict, description="policy parameters as a JSON object, e.g. '{\"scale_in_cooldown_s\": 60}'"
    )
    autoscale: bool = Field(False, description="run the autoscaling policy in the control loop")
    scale_from_zero: bool = Field(
        True,
        description="a request for a model the parameter manager lists, with no SERVING or LOADING instance, "
        "starts a scale-out of one IDLE worker (one at a time per model) and is answered UNAVAILABLE, so the "
        "gateway retries until the instance serves (as Knative's activator holds requests for a cold revision)",
    )
    advisory: bool = Field(False, description="decide and log, but do not act")
    decision_repeat_s: float = Field(
        30.0, gt=0, description="a 'no change' decision is reported when its reason changes, or this often"
    )
    history_window_s: float = Field(
        900.0, gt=0, description="GetHistory (the dashboard's past): events and cluster samples kept this long"
    )
    history_period_s: float = Field(
        1.0, gt=0, description="GetHistory: a cluster sample (request rate, TTFT, TBT, instances by state) this often"
    )
    history_max_events: int = Field(
        10_000, ge=1, description="GetHistory: at most this many events kept, the oldest dropped first"
    )
    prefix_overlap_weight: float = Field(
        1.0,
        ge=0,
        description="prefix-affinity routing (Dynamo's KV router cost): the instance that runs a prompt is the one "
        "with the least overlap_weight * (prompt blocks not cached there) + KV blocks in use (held, queued "
        "prompts', routed since its heartbeat), once some instance holds part of the prompt; cache hits are "
        "estimated from the block hashes of prompts routed to each instance; 0 = plain least-loaded routing",
    )
    prefix_index_blocks: int = Field(
        4096, gt=0, description="prefix-affinity routing: block hashes remembered per instance (least recent dropped)"
    )

    @model_validator(mode="after")
    def _check(self) -> GlobalManagerConfig:
        # Fail at start-up, quoting the bad parameter, rather than at the first tick.
        make_policy(self.policy, self.policy_params)
        if self.autoscale and not self.default_model:
            raise ValueError("autoscale=True needs default_model (the model the policy scales)")
        if self.history_period_s > self.history_window_s:
            raise ValueError(
                f"history_period_s={self.history_period_s!r} must be <= history_window_s={self.history_window_s!r}"
            )
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances={self.min_instances!r} must be <= max_instances={self.max_instances!r}")
        if (self.min_prefill > 0) != (self.min_decode > 0):
            # One pool alone is not a split deployment: every request would take the single-hop
            # fallback, which is colocated serving under another name.
            raise ValueError(
                f"min_prefill={self.min_prefill!r} and min_decode={self.min_decode!r}: set both > 0 "
                "(disaggregated) or both 0 (colocated)"
            )
        if self.disaggregated:
            if self.min_instances:
                # min_instances counts the colocated pool; one model served both ways at once
                # would split its traffic by an accident of routing.
                raise ValueError(
                    f"min_instances={self.min_instances!r} must be 0 with min_prefill={self.min_prefill!r} "
                    f"and min_decode={self.min_decode!r}: min_instances counts colocated instances"
                )
            if not self.default_model:
                raise ValueError(
                    f"min_prefill={self.min_prefill!r} and min_decode={self.min_decode!r} need default_model "
                    "(the model served disaggregated)"
                )
            if self.min_prefill + self.min_decode > self.max_instances:
                raise ValueError(
                    f"min_prefill={self.min_prefill!r} + min_decode={self.min_decode!r} must be <= "
                    f"max_instances={self.max_instances!r}"
                )
        return self

    @property
    def disaggregated(self) -> bool:
        """Whether default_model is served with prefill and decode on separate instances."""
        return self.min_prefill > 0 and self.min_decode > 0

    def pool_floors(self) -> dict[Role, int]:
        """Instances of default_model each pool keeps loaded: the prefill and decode pools when
        disaggregated, else the colocated one."""
        if self.disaggregated:
            return {Role.PREFILL: self.min_prefill, Role.DECODE: self.min_decode}
        return {Role.COLOCATED: self.min_instances}

    def floor_name(self, role: Role) -> str:
        """The setting behind a pool's floor, for messages."""
        return {Role.PREFILL: "min_prefill", Role.DECODE: "min_decode"}.get(role, "min_instances")
