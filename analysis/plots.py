"""Scaling plots as PNG bytes: speedup against ideal, efficiency, step-time breakdown, comm."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vitpod.analysis.runlogs import TIME_PARTS  # noqa: E402
from vitpod.analysis.scaling import Row  # noqa: E402

COLORS = {"data": "#4c72b0", "compute": "#55a868", "comm": "#c44e52", "optimizer": "#8172b2"}


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _ok(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.state == "ok"]


def _mark_failed(ax: Any, rows: list[Row]) -> None:
    for row in rows:
        if row.state != "ok":
            ax.axvline(row.gpus, color="red", linestyle=":", linewidth=1)
            ax.annotate("failed", (row.gpus, 0.02), xycoords=("data", "axes fraction"), color="red")


def speedup_plot(rows: list[Row], mode: str) -> bytes:
    good = _ok(rows)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    gpus = [r.gpus for r in good]
    ax.plot(gpus, [r.ideal_speedup or 0.0 for r in good], "k--", label="ideal")
    ax.plot(gpus, [r.speedup or 0.0 for r in good], "o-", label="measured")
    _mark_failed(ax, rows)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup")
    ax.set_title(f"{mode} scaling: speedup")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def efficiency_plot(rows: list[Row], mode: str, references: list[dict[str, Any]]) -> bytes:
    good = _ok(rows)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.axhline(100, color="k", linestyle="--", label="ideal")
    ax.plot([r.gpus for r in good], [100 * (r.efficiency or 0) for r in good], "o-", label="ours")
    for ref in references:
        ax.plot(ref["gpus"], 100 * ref["efficiency"], "s", label=ref["short"])
    _mark_failed(ax, rows)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("efficiency (%)")
    ax.set_ylim(0, 110)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{mode} scaling: efficiency")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


def breakdown_plot(rows: list[Row]) -> bytes:
    good = _ok(rows)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    labels = [str(r.gpus) for r in good]
    bottom = [0.0] * len(good)
    for part in TIME_PARTS:
        values = [1e3 * r.time[part] for r in good]
        ax.bar(labels, values, bottom=bottom, label=part, color=COLORS[part])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ms per optimizer step")
    ax.set_title("step-time breakdown")
    ax.legend(fontsize=7)
    return _png(fig)


def comm_plot(rows: list[Row]) -> bytes:
    good = [r for r in _ok(rows) if r.gpus > 1]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    labels = [str(r.gpus) for r in good]
    xs = range(len(good))
    ax.bar([x - 0.2 for x in xs], [1e3 * r.time["comm"] for r in good], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [1e3 * (r.predicted_comm_s or 0) for r in good], 0.4,
           label="predicted (cost model)")  # fmt: skip
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("communication ms per step")
    ax.set_title("communication: predicted vs measured")
    ax.legend(fontsize=7)
    return _png(fig)
