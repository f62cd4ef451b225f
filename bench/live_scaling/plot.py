"""The live-scaling figure: tokens served per second over time for each setup, with k/L of each
instance loading in that setup on the same time axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on the benchmark machines
import matplotlib.pyplot as plt


def loading_series(loading: list[tuple[float, dict[str, float]]]) -> dict[str, tuple[list[float], list[float]]]:
    """Per instance, (times, k/L) from samples of `{instance_id: k/L}` of the loading ones."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for t_s, fractions in loading:
        for iid, frac in fractions.items():
            xs, ys = out.setdefault(iid, ([], []))
            xs.append(t_s)
            ys.append(frac)
    return out


def plot(results: dict[str, dict[str, Any]], bin_s: float, title: str, out: Path) -> None:
    """`results[setup]` holds `tokens_per_s` (one value per `bin_s`) and `loading`
    ([(t_s, {instance_id: k/L})])."""
    setups = [s for s in results if results[s].get("tokens_per_s")]
    fig, axes = plt.subplots(len(setups), 1, figsize=(11, 2.2 * len(setups) + 0.8), sharex=True, squeeze=False)
    peak = max(max(results[s]["tokens_per_s"]) for s in setups)
    for ax, setup in zip(axes[:, 0], setups, strict=True):
        r = results[setup]
        rates = r["tokens_per_s"]
        ax.step([i * bin_s for i in range(len(rates))], rates, where="post", color="tab:blue", linewidth=1.4)
        ax.set_ylim(0, peak * 1.1)
        ax.set_ylabel("tokens/s", color="tab:blue")
        ax.set_title(
            f"{setup}: TTFT p99 {r['ttft_p99_s']:.2f} s, served while loading {r['served_while_loading']}"
            + (f", borrowed {r['borrowed']}" if r.get("borrowed") else ""),
            fontsize=9,
            loc="left",
        )
        kl = ax.twinx()
        for iid, (xs, ys) in sorted(loading_series(r.get("loading", [])).items()):
            kl.plot(xs, ys, marker=".", markersize=3, linewidth=1.0, label=iid)
        kl.set_ylim(0, 1.05)
        kl.set_ylabel("k/L loading", fontsize=8)
        if kl.get_legend_handles_labels()[0]:
            kl.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the replay started (s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
