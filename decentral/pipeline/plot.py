"""Pictures of plans: a Gantt chart per plan (one row per node) and the benchmark's bars."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from decentral.pipeline.network import Network
from decentral.pipeline.planner import Plan
from decentral.pipeline.simulator import BACKWARD, FORWARD, LOSS, Deadlock, simulate

COLOURS = {FORWARD: "tab:blue", LOSS: "tab:red", BACKWARD: "tab:orange"}


def plot_plans(network: Network, plans: Sequence[tuple[str, Plan]], out_png: str | Path) -> Path:
    """One Gantt panel per (title, plan), on one time axis: a row per node (name, region, stage),
    a box per forward, loss and backward, labelled with its microbatch (none for a plan that deadlocks)."""
    rows = len(network)
    fig = Figure(figsize=(14, 1.2 + 0.22 * rows * len(plans)), layout="constrained")
    axes = fig.subplots(len(plans), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, plan) in zip(axes, plans):
        try:
            timeline = simulate(network, plan.paths)
        except Deadlock:  # (network-blind skipping can order a node's work so that no microbatch can go on)
            ax.set_title(f"{title}: deadlocks (no iteration ends)", fontsize=9)
            continue
        order = sorted(range(rows), key=lambda n: (plan.stage_of[n], n))
        row_of = {node: row for row, node in enumerate(order)}
        for task in timeline.tasks:
            width = (task.end - task.start) / 1e3
            ax.broken_barh([(task.start / 1e3, width)], (row_of[task.node] - 0.4, 0.8),
                           facecolors=COLOURS[task.kind], edgecolors="white", linewidth=0.4)
            if task.kind != LOSS:
                ax.text(task.start / 1e3 + width / 2, row_of[task.node], str(task.microbatch), ha="center",
                        va="center", fontsize=5, color="white")
        ax.set_yticks(range(rows), [_label(network, plan, n) for n in order], fontsize=6)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_title(f"{title}: {timeline.makespan_ms / 1e3:.1f} s per iteration", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    fig.legend(handles=[Patch(color=colour, label=kind) for kind, colour in COLOURS.items()], loc="outside upper right",
               ncols=3, fontsize=8)
    return _save(fig, out_png)


def plot_bench(rows: Sequence[dict], out_png: str | Path, title: str = "") -> Path:
    """Bars of the simulated iteration time per seed: full pipeline, network-blind skipping, planned."""
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    kinds = (("full_s", "full pipeline"), ("blind_s", "network-blind skipping"), ("planned_s", "planned (SkipPipe)"))
    width = 0.8 / len(kinds)
    for k, (key, label) in enumerate(kinds):
        ax.bar([i + (k - 1) * width for i in range(len(rows))], [row[key] for row in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [f"seed {row['seed']}" for row in rows])
    ax.set_ylabel("simulated iteration time (s)")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    return _save(fig, out_png)


def _label(network: Network, plan: Plan, node: int) -> str:
    region = f" {network.nodes[node].region}" if network.nodes[node].region else ""
    return f"{network.nodes[node].name}{region} s{plan.stage_of[node]}"


def _save(fig: Figure, out_png: str | Path) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
