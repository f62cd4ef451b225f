"""ZigZag's layer-level model, simulated one layer-time at a time (docs/algorithms.md 3).

An old instance holds all L layers, a new one the first k. Time runs in layer-times (one layer
of one request on either instance). The new instance takes requests from an endless queue and
runs their layers [0, k), FCFS, then hands them over; the old instance finishes a handed-over
request's layers [k, L) when one is waiting, else runs a whole request of its own (the heuristic:
split requests first). Throughput (requests per layer-time) tends to the fluid optimum
`core.zigzag.pair_throughput(L, k)`: 1/L alone, 1/(L - k) while the old one is the bottleneck,
2/L from k = L/2 on. The cluster simulator uses that closed form as its partner speedup; this
discrete version is the check that the heuristic reaches it.
"""

from __future__ import annotations

__all__ = ["layer_level_throughput"]


def layer_level_throughput(num_layers: int, k_layers: int, horizon: int = 100_000) -> float:
    """Requests completed per layer-time by the pair over `horizon` layer-times."""
    if not 0 <= k_layers <= num_layers:
        raise ValueError(f"k_layers must be in [0, {num_layers}], got {k_layers!r}")
    done = 0
    relays = 0  # requests whose first k layers are done, waiting for the old instance
    new_left = k_layers  # layer-times left on the new instance's current request
    old_left = 0
    for _ in range(horizon):
        if k_layers > 0:
            new_left -= 1
            if new_left == 0:
                if k_layers == num_layers:
                    done += 1  # it holds every layer: a whole request on its own
                else:
                    relays += 1
                new_left = k_layers
        if old_left == 0:
            if relays:
                relays -= 1
                old_left = num_layers - k_layers
            else:
                old_left = num_layers
        old_left -= 1
        if old_left == 0:
            done += 1
    return done / horizon
