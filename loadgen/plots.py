"""PNG plots with matplotlib's Agg backend: Pareto frontier, TTFT and TPOT CDFs, throughput over time.

Imported only when plots are written, so the rest of loadgen runs without matplotlib."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from loadgen.metrics import throughput_timeline  # noqa: E402
from loadgen.summary import Summary  # noqa: E402


def _pareto(plt, summary: Summary, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    pts = [p for p in summary.pareto if p.per_user_tok_s is not None]
    ax.scatter([p.per_user_tok_s for p in pts], [p.tok_s_per_gpu for p in pts], color="tab:blue")
    for p in pts:
        ax.annotate(f"c={p.concurrency}", (p.per_user_tok_s, p.tok_s_per_gpu), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    front = sorted((p for p in pts if p.on_frontier), key=lambda p: p.per_user_tok_s)
    if front:
        ax.plot([p.per_user_tok_s for p in front], [p.tok_s_per_gpu for p in front], color="tab:red",
                label="frontier")
        ax.legend()
    ax.set_xlabel("per-user tok/s (1 / TPOT, p50)")
    ax.set_ylabel("total tok/s per GPU" if summary.run.gpus else "total tok/s (GPUs not given)")
    ax.set_title(f"Pareto: {summary.run.scenario} @ {summary.run.url}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(plt, summary: Summary, attr: str, label: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for lv in summary.levels:
        values = sorted(getattr(r, attr) * 1000.0 for r in lv.records if r.is_ok and getattr(r, attr) is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=f"c={lv.concurrency}")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{label} CDF")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput(plt, summary: Summary, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for lv in summary.levels:
        starts, rates = throughput_timeline(lv.records, bin_s=max(0.25, summary.run.duration_s / 60.0))
        if starts:
            ax.step(starts, rates, where="post", label=f"c={lv.concurrency}")
    ax.set_xlabel("seconds since level start")
    ax.set_ylabel("output tok/s")
    ax.set_title("Output throughput over time")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(summary: Summary, out_dir: Path) -> list[str]:
    """Write the four PNGs; returns their file names (relative to out_dir)."""
    names = ["pareto.png", "ttft_cdf.png", "tpot_cdf.png", "throughput.png"]
    _pareto(plt, summary, out_dir / names[0])
    _cdf(plt, summary, "ttft_s", "TTFT", out_dir / names[1])
    _cdf(plt, summary, "tpot_s", "TPOT", out_dir / names[2])
    _throughput(plt, summary, out_dir / names[3])
    return names
