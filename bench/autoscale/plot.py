"""The autoscale benchmark's figure: instances, request rate and TTFT p99 over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on the benchmark machines
import matplotlib.pyplot as plt

COLORS = {
    "autoscaled": "tab:blue",
    "autoscaled_bounds": "tab:cyan",
    "fixed_average": "tab:orange",
    "fixed_peak": "tab:green",
}


def _points(xs: list[float], ys: list[Any]) -> tuple[list[float], list[float]]:
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(
    runs: dict[str, dict[str, Any]], decisions: list[dict[str, Any]], ttft_slo_s: float, title: str, out: Path
) -> None:
    """`runs[name]` holds `timeline` (from blitzmesh.replay.timeline) and `samples` ([(t_s, held)]);
    `decisions` are the autoscaled run's scale decisions (t_s, target)."""
    fig, (ax_n, ax_r, ax_t) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [1.2, 1, 1.2]}
    )
    for name, run in runs.items():
        xs = [t for t, _ in run["samples"]]
        ys = [n for _, n in run["samples"]]
        ax_n.step(
            xs, ys, where="post", color=COLORS.get(name), label=name, linewidth=1.8 if name == "autoscaled" else 1.2
        )
        tl = run["timeline"]
        x, y = _points(tl["t_s"], tl["ttft_p99_s"])
        ax_t.plot(x, y, marker=".", color=COLORS.get(name), label=name, linewidth=1.0)
    for d in decisions:
        color = "tab:red" if d["target"] == "scale_out" else "tab:purple"
        ax_n.axvline(d["t_s"], color=color, alpha=0.35, linewidth=0.8, linestyle="--")
    ax_n.set_ylabel("instances\n(loading+serving+draining)")
    ax_n.legend(loc="upper right", fontsize=8)
    ax_n.set_title(title, fontsize=10)
    first = next(iter(runs.values()))["timeline"]
    width = (first["t_s"][1] - first["t_s"][0]) if len(first["t_s"]) > 1 else 1.0
    ax_r.bar(first["t_s"], first["rps"], width=width, align="edge", color="tab:gray", alpha=0.7)
    ax_r.set_ylabel("requests/s sent")
    ax_t.axhline(ttft_slo_s, color="tab:red", linewidth=0.8, linestyle=":", label=f"TTFT SLO {ttft_slo_s}s")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("TTFT p99 (s)\nper bin")
    ax_t.set_xlabel("replay time (s); dashed: scale-out (red) / scale-in (purple) decisions")
    ax_t.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
