"""Open-loop load replay against the gateway: trace or synthetic step/spike arrivals, per-request
TTFT/TBT/outcome and the instance count over time: trace reading (`trace`), arrival schedules
(`schedule`), the sender (`runner`, which needs aiohttp from the `services` extra) and summaries
(`summary`). Used by the burst tool (`blitzmesh replay`), `bench.*` and the e2e and chaos tests;
it imports nothing from `services` or `bench`."""

from .runner import ReplayResult, StreamState, prompt_ids, replay
from .schedule import (
    Arrival,
    TokenScaling,
    TraceWindow,
    describe,
    from_trace,
    piecewise_pattern,
    rate_per_bin,
    spike_pattern,
    step_pattern,
)
from .summary import (
    InstanceSample,
    RequestRecord,
    Slo,
    instance_seconds,
    percentile,
    percentiles,
    summarize,
    timeline,
    token_rate,
)
from .trace import TraceRow, parse_timestamp, parse_timestamp_ns, read_azure_trace

__all__ = [
    "Arrival",
    "InstanceSample",
    "ReplayResult",
    "RequestRecord",
    "Slo",
    "StreamState",
    "TokenScaling",
    "TraceRow",
    "TraceWindow",
    "describe",
    "from_trace",
    "instance_seconds",
    "parse_timestamp",
    "parse_timestamp_ns",
    "percentile",
    "percentiles",
    "piecewise_pattern",
    "prompt_ids",
    "rate_per_bin",
    "read_azure_trace",
    "replay",
    "spike_pattern",
    "step_pattern",
    "summarize",
    "timeline",
    "token_rate",
]
