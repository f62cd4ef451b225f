"""Validated configuration of the gateway: public ports, upstream addresses, admission limits."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.common.config import ServiceConfig


class GatewayConfig(ServiceConfig):
    """Everything the gateway reads; `BLITZMESH_GATEWAY_<FIELD>` or `--field-name` override."""

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
        default_factory=list, description="accepted bearer keys (JSON list on the CLI); empty = no auth"
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
    ready_timeout_s: float = Field(
        0.0, ge=0, description="give up (exit) if the managers are not reachable by then; 0 = wait forever"
    )

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        if any(not key.strip() for key in self.api_keys):
            raise ValueError(f"api_keys holds an empty key ({len(self.api_keys)} keys given)")
        if self.port != 0 and self.http_port == self.port and self.http_host == self.host:
            raise ValueError(f"http_port={self.http_port} equals the gRPC port={self.port} on {self.host!r}")
        if not self.global_manager or not self.param_manager:
            raise ValueError(
                f"global_manager={self.global_manager!r} and param_manager={self.param_manager!r} are both required"
            )
        return self
