"""`decentral report RUN_DIR`: redraw the loss plot of any run from its metrics and print its summary table.

A run folder is any folder with metrics.jsonl files at any depth: a `decentral train` OUT (an island's
ranks in OUT/rankR), a demo's OUT/w*, a bench's OUT/METHOD/w*, `bench sweep`'s OUT/pointK/w*, `bench soak`'s
OUT/RUN/w*, a branch-train-merge folder of expert runs (runs/btm/NAME), a pipeline run's OUT/LEAD. Workers
of different files that share a name (the w0 of every bench method) are told apart by the folders they
are in, e.g. `diloco/w0`, using as few of the folder levels below RUN_DIR as that takes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from decentral.metrics import check_picture_path, read_metrics, write_report

METRICS_FILE = "metrics.jsonl"


class ReportError(Exception):
    """There is nothing to report in the folder given; the message says what was looked for."""


def find_metrics(run: Path) -> list[Path]:
    """`run` itself when it is a metrics file, else every metrics.jsonl under it, sorted; ReportError if none."""
    if run.is_file():
        return [run]
    if not run.is_dir():
        raise ReportError(f"{run} does not exist")
    found = sorted(run.rglob(METRICS_FILE))
    if not found:
        raise ReportError(f"no {METRICS_FILE} under {run}: give the --out folder of a train, demo or bench run")
    return found


def read_run(run: Path) -> list[dict]:
    """The records of every metrics file of `run` (`find_metrics`), their `worker` names made unique
    across files (module docstring); a record without one is named after its file's folder."""
    files = find_metrics(run)
    records = {path: [{**r, "worker": str(r.get("worker", path.parent.name))} for r in read_metrics(path)]
               for path in files}
    folders = {path: path.parent.relative_to(run).parts if run.is_dir() else () for path in files}
    pairs = {(path, r["worker"]) for path, rows in records.items() for r in rows}
    for depth in range(max(map(len, folders.values()), default=0) + 1):  # depth 0: the names as they are
        label = {(path, worker): "/".join([*folders[path][:depth], worker]) for path, worker in pairs}
        if len(set(label.values())) == len(pairs):
            break
    return [{**r, "worker": label[path, r["worker"]]} for path, rows in records.items() for r in rows]


def main(args: argparse.Namespace) -> int:
    """Write the plot, print the table; 2 with one line when the folder has no metrics."""
    run = Path(args.run)
    try:
        records = read_run(run)
    except (ReportError, ValueError) as e:  # ValueError: a malformed metrics line (file:line)
        print(f"decentral: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"decentral: the metrics files under {run} hold no records yet", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (run if run.is_dir() else run.parent) / "report.png"
    check_picture_path(out)
    summary = write_report(records, out, title=str(run))
    print(f"report: plot {out}; workers: {len(summary)}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN_DIR", help="a run's output folder (or one metrics.jsonl)")
    parser.add_argument("--out", metavar="PNG", help="where to draw the plot (default: RUN_DIR/report.png)")
    parser.set_defaults(func=main)
