"""Figures of the simulated comparison: attainment (with its 95 % bootstrap interval), TTFT, TPOT and
throughput against rate per workload (Fig. 15 / Fig. 22 style), and the chunked baseline's
timeline (Fig. 20b style; Bullet's own timeline is `artifact.plots.plot_timeline`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from artifact.plots import draw_series  # noqa: E402
from bullet.loops.timeline import load_timeline  # noqa: E402

PANELS = [("attainment", "SLO attainment", 1.0), ("mean_ttft_s", "mean TTFT (s)", 1.0),
          ("mean_tpot_s", "mean TPOT (ms)", 1e3), ("output_tok_per_s", "throughput (tok/s)", 1.0)]


def plot_comparison(results: dict, path: Path, titles: dict, slos: dict, suptitle: str) -> Path:
    """One row per workload, one panel per metric; runs stopped early are crossed (their means are
    partial)."""
    fig, axes = plt.subplots(len(results), 4, figsize=(17, 3.4 * len(results)), squeeze=False)
    for row, (wl, by_system) in zip(axes, results.items()):
        for ax, (key, label, scale) in zip(row, PANELS):
            for system, res in by_system.items():
                draw_series(ax, system, res["per_rate"], key, scale, ms=3)
                stopped = [r for r in res["per_rate"] if res["per_rate"][r]["run"]["stopped_early"]]
                ax.plot([float(r) for r in stopped], [res["per_rate"][r][key] * scale for r in stopped], "x",
                        color="gray", ms=6)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if key == "mean_ttft_s":
                ax.set_yscale("log")
        row[0].axhline(0.9, color="gray", linestyle=":")
        ttft, tpot = slos[wl]
        row[0].set_title(f"{titles[wl]} (TTFT {ttft}, TPOT {tpot})", fontsize=10, loc="left")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_chunked_timeline(directory: Path, path: Path) -> Path:
    """Fig. 20b-like: the chunked baseline's hybrid batches and queue over time."""
    rows = load_timeline(directory)
    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(12, 6), sharex=True)
    axes[0].plot(t, [r["tokens"] for r in rows], ".", ms=2)
    axes[0].set_ylabel("tokens / step")
    axes[1].plot(t, [r["batch"] for r in rows], ".", ms=2, color="tab:orange")
    axes[1].set_ylabel("running requests")
    axes[2].plot(t, [r["queue"] for r in rows], ".", ms=2, color="tab:red")
    axes[2].set_ylabel("waiting")
    axes[2].set_xlabel("time (s)")
    fig.suptitle("SIMULATED chunked prefill: hybrid batches on the whole device")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_normalized_latency(data: dict, path: Path) -> Path:
    """Fig. 17 style: mean normalized latency against rate, one panel per workload, one line per
    system, the paper's quoted points as crosses in the same colour (`artifact.fig17`'s results)."""
    curves = data["curves"]
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    setup = data["setup"]
    for ax, (wl, by_system) in zip(axes[0], curves.items()):
        for system, per_rate in by_system.items():
            draw_series(ax, f"{system} (simulated)", per_rate, "mean_norm_latency_s", 1e3)
            color = ax.get_lines()[-1].get_color()
            quoted = [p for p in data["paper"] if p["workload"] == wl and p["system"] == system]
            if quoted:
                ax.plot([p["rate"] for p in quoted], [p["mean_norm_latency_s"] * 1e3 for p in quoted], "X",
                        color=color, ms=10, label=f"{quoted[0].get('name', system)}: paper §4.2.2")
        ax.set_title(f"{wl} (TTFT {setup['slos'][wl][0]}, TPOT {setup['slos'][wl][1]})", fontsize=10, loc="left")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("mean normalized latency (ms/token)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    link = setup["link"]
    fig.suptitle(f"SIMULATED {setup['model']} on {setup['tp_size']}x A100, tensor-parallel over "
                 f"{link['bus_bandwidth'] / 1e9:g} GB/s (roofline device model; crosses: the paper's quoted numbers)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
