"""The figure of `python -m bench.dataplane`: one panel per part, from the results dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GIB = 1 << 30


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Write the 2x2 figure to `path`; None (and nothing written) if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    quick = " (--quick)" if results.get("quick") else ""
    fig.suptitle(f"bench.dataplane{quick}: parameter transfer on {results['machine']['cpus']} cores", fontsize=12)

    # 1. One hop on one host, GB/s.
    ax = axes[0][0]
    bars: list[tuple[str, float]] = [("memcpy", results.get("memcpy_gbps") or 0.0)]
    for label, key in (
        ("ucx_perftest\n(^cma)", "ucx_perftest_gbps"),
        ("ucx_perftest\n(all tls)", "ucx_perftest_all_tls_gbps"),
    ):
        if results.get(key):
            bars.append((label, results[key]))
    colors = ["#999999"] + ["#bbbbbb"] * (len(bars) - 1)
    # Per kind: the transport alone (like ucx_perftest), then the whole pull with checksums.
    transport = results.get("one_hop_transport_gbps") or {}
    for kind, v in (results.get("one_hop_gbps") or {}).items():
        if kind in transport:
            bars.append((f"{kind}\ntransport", transport[kind]))
            colors.append("#9ecae1")
        bars.append((f"{kind}\npull", v))
        colors.append("#1f77b4")
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=colors)
    for i, (_, v) in enumerate(bars):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"1. one hop on one host, {results['payload_bytes'] / GIB:g} GiB (best warm run)", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)

    shaped = results.get("shaped") or {}
    link = results.get("shaped_link") or {}
    link_label = f"{link.get('rate_mbit', '?')} Mbit tbf uplinks, {link.get('payload_bytes', 0) / (1 << 20):.0f} MiB"

    # 2. Chain vs sequential unicast over shaped links.
    colors_by_kind = {"ucx": "#1f77b4", "tcp": "#ff7f0e"}
    ax = axes[0][1]
    ideal = None
    if shaped:
        for kind, res in shaped.items():
            if "chain_fill_s" not in res:
                continue
            c = colors_by_kind.get(kind)
            ns = sorted(res["chain_fill_s"], key=int)
            ax.plot([int(n) for n in ns], [res["chain_fill_s"][n] for n in ns], "o-", color=c, label=f"chain ({kind})")
            ns = sorted(res["unicast_fill_s"], key=int)
            ax.plot(
                [int(n) for n in ns],
                [res["unicast_fill_s"][n] for n in ns],
                "s--",
                color=c,
                label=f"sequential unicast ({kind})",
            )
            ideal = res.get("ideal_hop_s")
        if ideal:
            ax.axhline(ideal, color="gray", ls=":", lw=1, label="payload / link rate")
        ax.set_xlabel("targets n")
        ax.set_ylabel("seconds until every target holds the model")
        ax.set_xticks(sorted({int(n) for r in shaped.values() for n in r.get("chain_fill_s", {})}))
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        ax.text(0.5, 0.5, f"skipped: {results.get('shaped_skipped', '')}", ha="center", va="center", wrap=True)
    ax.set_title(f"2. chain vs unicast, netns hosts, {link_label}", fontsize=10)

    # 3. Sharded transfer.
    ax = axes[1][0]
    if shaped:
        gs_all: set[int] = set()
        for kind, res in shaped.items():
            if "sharded_s" not in res:
                continue
            c = colors_by_kind.get(kind)
            gs = sorted(res["sharded_s"], key=int)
            gs_all.update(int(g) for g in gs)
            ax.plot([int(g) for g in gs], [res["sharded_s"][g] for g in gs], "o-", color=c, label=f"measured ({kind})")
            t1 = res["sharded_s"][gs[0]] * int(gs[0])
            ax.plot(
                [int(g) for g in gs], [t1 / int(g) for g in gs], ":", color=c, alpha=0.6, label=f"t(g=1) / g ({kind})"
            )
        ax.set_xlabel("sources g")
        ax.set_xticks(sorted(gs_all))
        ax.set_ylabel("seconds until the target holds the model")
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    ax.set_title(f"3. sharded transfer: g sources into one target, {link_label}", fontsize=10)

    # 4. Host memory.
    ax = axes[1][1]
    hm = results.get("host_memory") or {}
    if results.get("host_bytes_o1"):
        hs = sorted(results["host_bytes_o1"], key=int)
        x = [int(h) for h in hs]
        gib = float(GIB)
        ax.plot(
            x,
            [results["host_bytes_per_host"][h] / gib for h in hs],
            "s-",
            color="#d62728",
            label="per-host cache: reported bytes",
        )
        ax.plot(
            x, [results["host_bytes_o1"][h] / gib for h in hs], "o-", color="#2ca02c", label="O(1) pool: reported bytes"
        )
        if hm.get("host_rss_growth_per_host"):
            ax.plot(
                x,
                [hm["host_rss_growth_per_host"][h] / gib for h in hs],
                "s:",
                color="#d62728",
                alpha=0.6,
                label="per-host: RSS growth",
            )
            ax.plot(
                x,
                [hm["host_rss_growth_o1"][h] / gib for h in hs],
                "o:",
                color="#2ca02c",
                alpha=0.6,
                label="O(1): RSS growth",
            )
        ax.set_xlabel("hosts H")
        ax.set_xticks(x)
        ax.set_ylabel("GiB of host memory, all hosts")
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    ax.set_title(
        f"4. host memory, model of {hm.get('model_bytes', 0) / (1 << 20):.0f} MiB (real processes)", fontsize=10
    )

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
