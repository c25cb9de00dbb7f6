"""Figures of a comparison run: SLO attainment, TTFT and TPOT against request rate (Bullet Fig. 15
style), and the Bullet timeline of compute shares and batches (Fig. 20 style). Attainment is drawn with its
95 % bootstrap interval when the results carry one (artifact/stats.py)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bullet.loops.timeline import load_timeline


def plot_comparison(out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    data = json.loads((out_dir / "results.json").read_text())
    systems = data["systems"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [("attainment", "SLO attainment", 1.0), ("mean_ttft_s", "mean TTFT (s)", 1.0),
              ("mean_tpot_s", "mean TPOT (ms)", 1e3), ("output_tok_per_s", "throughput (tok/s)", 1.0)]
    for ax, (key, label, scale) in zip(axes, panels):
        for system, res in systems.items():
            draw_series(ax, system, res["per_rate"], key, scale)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].axhline(0.9, color="gray", linestyle=":")
    axes[0].legend(fontsize=8)
    slo = data["slo"]
    fig.suptitle(f"ShareGPT on this CPU — SLO: TTFT {slo['ttft_s_per_token'] * 1e3:.1f} ms/token, "
                 f"TPOT {slo['tpot_s'] * 1e3:.0f} ms")
    fig.tight_layout()
    paths = [out_dir / "comparison.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    timeline = out_dir / "timeline" / "bullet"
    if timeline.exists():
        paths.append(plot_timeline(timeline, out_dir / "timeline_bullet.png"))
    return paths


def draw_series(ax, system: str, per_rate: dict, key: str, scale: float, **style) -> None:
    """One system's line over the rates; attainment gets its 95 % bootstrap interval as error bars."""
    rates = sorted(per_rate, key=float)
    x = [float(r) for r in rates]
    y = [per_rate[r][key] * scale for r in rates]
    style = {"marker": "o", "ms": 4, "label": system, "linewidth": 2.5 if system == "bullet" else 1.2, **style}
    cis = [per_rate[r].get("attainment_ci") for r in rates]
    if key == "attainment" and all(cis):
        err = [[v - ci["low"] for v, ci in zip(y, cis)], [ci["high"] - v for v, ci in zip(y, cis)]]
        ax.errorbar(x, y, yerr=err, capsize=3, **style)
    else:
        ax.plot(x, y, **style)


def plot_timeline(timeline_dir: Path, path: Path) -> Path:
    rows = load_timeline(timeline_dir)
    if not rows:
        return path
    t0 = rows[0]["t"]
    fig, axes = plt.subplots(3, 1, figsize=(12, 6.5), sharex=True)
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        mine = [r for r in rows if r["role"] == role]
        axes[0].step([r["t"] - t0 for r in mine], [r["units"] if r.get("run", True) else 0 for r in mine],
                     where="post", color=color, label=f"{role} units")
        axes[1].plot([r["t"] - t0 for r in mine], [r.get("batch", 0) for r in mine], ".", ms=3, color=color,
                     label=f"{role} batch")
    pre = [r for r in rows if r["role"] == "prefill"]
    axes[2].plot([r["t"] - t0 for r in pre], [r.get("queue", 0) for r in pre], ".", ms=3, color="tab:red")
    axes[0].set_ylabel("compute units")
    axes[1].set_ylabel("requests in batch")
    axes[2].set_ylabel("prefill queue")
    axes[2].set_xlabel("time (s)")
    for ax in axes[:2]:
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle("Bullet: compute shares, batches and queue over time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
