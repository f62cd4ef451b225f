"""When a worker's backlog is news: the rule both ends of a heartbeat apply.

A worker heartbeats once a period; a burst that queues prompts on it between two heartbeats
would reach the manager's queue-aware trigger up to a period late. So the worker sends a
heartbeat at once when its queued prompts' wait passes a floor and at least doubles what its
last heartbeat said, and the manager runs its control loop at once on such a heartbeat, rather
than at its next tick.
"""

from __future__ import annotations

__all__ = ["BACKLOG_CHECK_S", "BACKLOG_FLOOR_S", "backlog_is_news", "sample_wait_s"]

# The queued prompts' wait, in seconds, below which a backlog is not news (the worker's default
# `heartbeat_backlog_wait_s`; half the manager's default queue target).
BACKLOG_FLOOR_S = 0.25
# How often, between heartbeats, a worker looks at its queue (the worker's default
# `heartbeat_backlog_check_s`; the simulator's workers too).
BACKLOG_CHECK_S = 0.25


def backlog_is_news(wait_s: float, reported_wait_s: float, floor_s: float = BACKLOG_FLOOR_S) -> bool:
    """Whether a queued prompts' wait of `wait_s` is worth acting on before the next period: at
    least `floor_s` and at least twice `reported_wait_s`, the wait last reported (a backlog
    formed, or doubled)."""
    return wait_s >= floor_s and wait_s >= 2 * reported_wait_s


def sample_wait_s(queued_prompt_tokens: float, prefill_capacity_tps: float) -> float:
    """Queued prompt tokens at a measured prefill capacity, in seconds; 0 without a capacity."""
    return queued_prompt_tokens / prefill_capacity_tps if prefill_capacity_tps > 0 else 0.0
