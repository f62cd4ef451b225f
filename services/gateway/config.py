"""Validated configuration of the gateway: public ports, upstream addresses, admission limits, keys."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.config import ServiceConfig
from services.gateway.auth import masked


class ModelSLODefaults(BaseModel):
    """One model's default latency objectives; a field left unset falls back to the gateway-wide
    default of its kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_s: float | None = Field(None, gt=0, description="default TTFT objective of the model, seconds")
    tpot_s: float | None = Field(None, gt=0, description="default TPOT objective of the model, seconds")


class GatewayConfig(ServiceConfig):
    """Everything the gateway reads; `BLITZMESH_GATEWAY_<FIELD>` or `--field-name` override."""

    # The input holds the API keys: messages quote what they need, masked.
    model_config = ConfigDict(hide_input_in_errors=True)

    port: int = Field(50051, ge=0, le=65535, description="gRPC port of the SDK API; 0 picks a free one")
    http_host: str = Field("127.0.0.1", description="address the OpenAI-compatible HTTP API binds to")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one")
    global_manager: str = Field("127.0.0.1:50052", description="global manager gRPC address (routes requests)")
    param_manager: str = Field("127.0.0.1:50053", description="parameter manager gRPC address (tokenizers)")
    max_concurrency: int = Field(256, ge=1, description="requests in flight at once; more wait in the queue")
    max_queue: int = Field(1024, ge=0, description="requests waiting for a slot; beyond it: 429")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait in the queue before a 429")
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens when a request gives none (capped by the context left)"
    )
    max_n: int = Field(
        16,
        ge=1,
        le=128,
        description="most choices one request may ask for (n); each choice is a request to a worker of its own, "
        "all under the request's one admission slot",
    )
    max_body_bytes: int = Field(1024 * 1024, ge=1024, description="largest HTTP request body; beyond it: 413")
    api_keys: list[str] = Field(
        default_factory=list,
        description="accepted bearer keys of the inference API (JSON list on the CLI); empty = no auth. They never "
        "authorize an admin call",
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="bearer keys of the gRPC Admin calls that change or reveal the cluster (GetCluster, Scale, "
        "SetPolicy, WatchEvents; JSON list on the CLI). Set: every admin call needs one, from loopback too. Empty: "
        "admin calls are accepted only from loopback peers (127.0.0.1, ::1; see admin_allow_loopback), so `make up` "
        "and an SDK on the same machine work and a remote caller gets PERMISSION_DENIED. An admin key does not "
        "authorize inference, and no key may be in both lists",
    )
    admin_allow_loopback: bool = Field(
        True,
        description="while admin_api_keys is empty, accept admin calls from loopback peers without a key; turn it "
        "off when a proxy on this host forwards remote callers (they would all look local): admin calls are then "
        "refused until admin_api_keys is set",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of a whole request, queue excluded")
    retries_before_first_token: int = Field(
        2, ge=0, le=10, description="re-routes to another instance when one fails before the first token"
    )
    max_migrations: int = Field(
        3,
        ge=0,
        le=20,
        description="times one request may move to another instance after its stream started (its instance died, "
        "hung or drained): it resumes there from the prompt plus the tokens generated so far; 0 = never",
    )
    token_stall_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a stream that has started and then gets no token for this long is treated as a hung instance "
        "and migrated; 0 = never (a slow prefill before the first token is not a stall)",
    )
    rpc_timeout_s: float = Field(10.0, gt=0, description="deadline of control RPCs (Schedule, GetModelFiles)")
    schedule_wait_s: float = Field(
        15.0,
        ge=0,
        description="how long a request waits for a route while the global manager is unreachable (a restart) "
        "or has no SERVING instance yet (a scale-out filling), retrying with backoff within the request's "
        "deadline; 0 = fail at once",
    )
    default_ttft_slo_s: float | None = Field(
        None,
        gt=0,
        description="TTFT objective (gateway accepting a request -> its first token, seconds) of requests that set "
        "no ttft_slo_s; None = no objective. Per-model values in model_slo_defaults win over it",
    )
    default_tpot_slo_s: float | None = Field(
        None,
        gt=0,
        description="TPOT objective (mean seconds per output token after the first) of requests that set no "
        "tpot_slo_s; None = no objective",
    )
    model_slo_defaults: dict[str, ModelSLODefaults] = Field(
        default_factory=dict,
        description='per-model default objectives by model id (the request\'s "model"), e.g. '
        '{"tiny": {"ttft_s": 2.0, "tpot_s": 0.1}} (JSON on the CLI); a kind a model leaves unset takes '
        "default_ttft_slo_s / default_tpot_slo_s",
    )
    ready_timeout_s: float = Field(
        0.0, ge=0, description="give up (exit) if the managers are not reachable by then; 0 = wait forever"
    )
    kv_block_size_tokens: int = Field(
        16,
        gt=0,
        description="tokens per KV block on the workers (their --block-size): the prompt's block hashes sent to the "
        "global manager for prefix-affinity routing are over blocks of this size",
    )
    prefix_routing_max_blocks: int = Field(
        128,
        ge=0,
        description="prefix-affinity routing: hashes of at most this many of the prompt's first KV blocks go with "
        "each Schedule call; 0 = none (the manager routes by load alone)",
    )

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        for name, keys in (("api_keys", self.api_keys), ("admin_api_keys", self.admin_api_keys)):
            if any(not key.strip() for key in keys):
                raise ValueError(f"{name} holds an empty key ({len(keys)} keys given)")
            # A header's key is stripped before it is compared, so such a key could never match.
            spaced = [masked(key) for key in keys if key != key.strip()]
            if spaced:
                raise ValueError(f"{name} holds keys with surrounding whitespace: {spaced}")
        shared = sorted(masked(key) for key in set(self.api_keys) & set(self.admin_api_keys))
        if shared:
            raise ValueError(
                f"keys {shared} are in both api_keys and admin_api_keys: one key has one role, so an inference "
                "key can never authorize an admin call"
            )
        if self.port != 0 and self.http_port == self.port and self.http_host == self.host:
            raise ValueError(f"http_port={self.http_port} equals the gRPC port={self.port} on {self.host!r}")
        for name in ("default_ttft_slo_s", "default_tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
        for model, slo in self.model_slo_defaults.items():
            if not model:
                raise ValueError("model_slo_defaults holds an empty model id")
            for kind, value in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s)):
                if value is not None and not math.isfinite(value):
                    raise ValueError(f"model_slo_defaults[{model!r}].{kind} must be finite, got {value!r}")
        if not self.global_manager or not self.param_manager:
            raise ValueError(
                f"global_manager={self.global_manager!r} and param_manager={self.param_manager!r} are both required"
            )
        return self
