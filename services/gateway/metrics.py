"""Prometheus metrics of the gateway, on a registry of their own so tests can make many."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from blitzmesh.types import SLOAttainment

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TBT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def slo_label(seconds: float) -> str:
    """An objective's value as a label: up to 6 significant digits, no trailing zeros ('0.5',
    '2', '0.001'), so equal objectives share one series however the client wrote them."""
    return format(seconds, "g")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "blitzmesh_gateway_requests",
            "Requests by front end and outcome (stop, length, cancelled, invalid, overloaded, ...)",
            ["api", "outcome"],
            registry=r,
        )
        self.ttft_s = Histogram(
            "blitzmesh_gateway_ttft_seconds",
            "Time from admission to the first token sent to the client",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tbt_s = Histogram(
            "blitzmesh_gateway_tbt_seconds",
            "Time between consecutive token messages from the worker, per token",
            buckets=_TBT_BUCKETS_S,
            registry=r,
        )
        self.queue_wait_s = Histogram(
            "blitzmesh_gateway_queue_wait_seconds",
            "Time a request waited for an admission slot",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tokens = Counter(
            "blitzmesh_gateway_tokens", "Tokens processed, by kind (prompt, completion)", ["kind"], registry=r
        )
        self.in_flight = Gauge("blitzmesh_gateway_in_flight", "Requests holding an admission slot", registry=r)
        self.queue_depth = Gauge("blitzmesh_gateway_queue_depth", "Requests waiting for a slot", registry=r)
        self.retries = Counter(
            "blitzmesh_gateway_retries",
            "Re-routes after an instance failed before the first token, by gRPC status",
            ["code"],
            registry=r,
        )
        self.migrations = Counter(
            "blitzmesh_gateway_migrations",
            "Streams resumed on another instance after theirs failed mid-stream, by gRPC status of the failure",
            ["code"],
            registry=r,
        )
        self.moves = Counter(
            "blitzmesh_gateway_moves",
            "Queued requests an instance released to another one (rebalancing), by reason",
            ["reason"],
            registry=r,
        )
        self.handoffs = Counter(
            "blitzmesh_gateway_kv_handoffs",
            "Disaggregated requests: 'handed_off' (prefill emitted the first token and offered its KV to a decode"
            " instance) or 'prefill_finished' (the first token ended the request)",
            ["outcome"],
            registry=r,
        )
        self.esp_groups = Counter(
            "blitzmesh_gateway_esp_groups",
            "Attempts routed to an ESP group (elastic sequence parallelism), by the group's degree",
            ["degree"],
            registry=r,
        )
        self.zigzag = Counter(
            "blitzmesh_gateway_zigzag",
            "ZigZag requests: 'routed' (split with a loading instance), then how the loading instance's part"
            " ended: 'relayed' (layers ran there, then its partner took over), 'none_ran', 'failed', or"
            " 'cancelled' (still running when the partner's stream ended or failed)",
            ["outcome"],
            registry=r,
        )
        self.slo_requests = Counter(
            "blitzmesh_gateway_slo_requests",
            "Finished requests with a latency objective, by kind (ttft, tpot), the objective's value in seconds"
            " (its class, e.g. '0.5') and whether it was met",
            ["kind", "slo", "met"],
            registry=r,
        )

    def observe_slo(self, attainment: SLOAttainment) -> None:
        """Count a finished request's attainment, one sample per objective it had."""
        for kind, objective, met in (
            ("ttft", attainment.ttft_s, attainment.ttft_met),
            ("tpot", attainment.tpot_s, attainment.tpot_met),
        ):
            if objective is not None and met is not None:
                self.slo_requests.labels(kind, slo_label(objective), "true" if met else "false").inc()

    def set_admission(self, in_flight: int, waiting: int) -> None:
        self.in_flight.set(in_flight)
        self.queue_depth.set(waiting)
