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
