"""The paper-scale figures (`bench.simulate.paper`): the scaling timeline (GPUs held over time
per system, with the request rate) and the TTFT CDF per system, one panel per setting, drawn
from the `paper` record alone so they can be redrawn from `bench/results/simulator.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on the benchmark machines
import matplotlib.pyplot as plt

__all__ = ["COLORS", "plot_esp_degrees", "plot_paper", "plot_timeline", "plot_ttft_cdf"]

COLORS = {
    "blitzmesh": "tab:blue",
    "serverlessllm": "tab:red",
    "hpa": "tab:orange",
    "fixed_peak": "tab:gray",
    "fixed_same_slo": "tab:green",
    "hpa_same_slo": "tab:purple",
}
# The timeline leaves out plain `hpa` (its tuned `hpa_same_slo` is the one compared).
TIMELINE_SYSTEMS = ("fixed_peak", "fixed_same_slo", "hpa_same_slo", "serverlessllm", "blitzmesh")
TIMELINE_PNG = "simulator_paper_timeline.png"
CDF_PNG = "simulator_paper_ttft_cdf.png"


def _panels(paper: dict[str, Any], height: float) -> tuple[Any, list[tuple[Any, str, dict[str, Any]]]]:
    settings = paper["settings"]
    fig, axes = plt.subplots(len(settings), 1, figsize=(14, height * len(settings) + 0.8), squeeze=False)
    return fig, [(ax, name, s) for ax, (name, s) in zip(axes[:, 0], settings.items(), strict=True)]


def _save(fig: Any, title: str, out: Path) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_timeline(paper: dict[str, Any], out: Path) -> Path:
    """Per setting: GPUs held by each system over time (lines), request rate (shaded, right axis)."""
    fig, panels = _panels(paper, 2.8)
    for ax, name, s in panels:
        rate_ax = ax.twinx()
        drawn_rate = False
        for system in TIMELINE_SYSTEMS:  # blitzmesh last, on top
            r = s["systems"].get(system)
            if r is None:
                continue
            tl = r["timeline"]
            ts = [i * tl["bin_s"] / 60 for i in range(len(tl["gpus"]))]
            if not drawn_rate:
                rate_ax.fill_between(ts, tl["rps"], step="post", color="0.85", zorder=0)
                rate_ax.set_ylabel("requests/s", color="0.4")
                rate_ax.set_ylim(bottom=0)
                drawn_rate = True
            label = f"{system} ({r['gpu_seconds'] / 3600:,.1f} GPU-h, TTFT p99 {r['ttft_p99_s']} s)"
            ax.step(ts, tl["gpus"], where="post", color=COLORS.get(system), linewidth=1.3, label=label)
        ax.set_zorder(rate_ax.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.set_ylabel("GPUs held")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{name}: {s['description']}", fontsize=8, loc="left")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.07, 1.0))
        ax.set_xlabel("minutes")
    title = f"Scaling timeline (simulated, scale {paper['scale']:g} of {paper['gpus_at_scale_1']:,} GPUs)"
    return _save(fig, title, out)


def plot_ttft_cdf(paper: dict[str, Any], out: Path) -> Path:
    """Per setting: the CDF of TTFT for each system (log time axis), the TTFT SLO marked."""
    fig, panels = _panels(paper, 2.6)
    quantiles = paper["ttft_quantile_levels"]
    for ax, name, s in panels:
        for system, r in s["systems"].items():
            xs = r["ttft_quantiles_s"]
            if not xs:
                continue
            ax.step([max(x, 1e-3) for x in xs], quantiles[: len(xs)], where="post", color=COLORS.get(system))
            ax.plot([], [], color=COLORS.get(system), label=f"{system} (p99 {r['ttft_p99_s']} s)")
        ax.axvline(paper["slo"]["ttft_s"], color="k", linestyle=":", linewidth=1, label="TTFT SLO")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name}: {s['description']}", fontsize=8, loc="left")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    title = f"TTFT CDF (simulated, scale {paper['scale']:g} of {paper['gpus_at_scale_1']:,} GPUs)"
    return _save(fig, title, out)


def plot_paper(paper: dict[str, Any], folder: Path) -> list[Path]:
    return [plot_timeline(paper, folder / TIMELINE_PNG), plot_ttft_cdf(paper, folder / CDF_PNG)]


def plot_esp_degrees(regimes: dict[str, Any], out: Path) -> Path:
    """ESP's group degree over time (`bench.simulate --scenario esp`): a row per regime, a panel
    per rate (the lowest tried, ESP's max rate at SLO), each prefill batch a point at its start
    (its degree; larger with more requests), from each regime's `degree_timeline`."""
    fig, axes = plt.subplots(len(regimes), 2, figsize=(14, 2.6 * len(regimes) + 0.6), squeeze=False)
    for row, (name, r) in zip(axes, regimes.items(), strict=True):
        sc = r["scenario"]
        timelines = list(r["degree_timeline"].items())
        for ax, (rate, points) in zip(row, timelines + timelines[-1:] * (2 - len(timelines)), strict=True):
            if points:
                t, u, k = zip(*(tuple(float(x) for x in p.split(":")) for p in points.split()), strict=True)
                ax.scatter(t, u, s=[6 + 4 * x for x in k], alpha=0.5, color="tab:blue")
            ax.set_title(f"{name} ({sc['instances']} x {sc['profile']}, {sc['mix']} mix) at {rate} rps", fontsize=9)
            ax.set_yscale("log", base=2)
            ax.set_yticks([1, 2, 4, 8], ["1", "2", "4", "8"])
            ax.set_ylabel("group degree")
    for ax in axes[-1]:
        ax.set_xlabel("simulated time (s); a point per prefill batch, larger = more requests")
    return _save(fig, "ESP prefill group degree over time: lowest rate (left), max rate at SLO (right), EMULATED", out)
