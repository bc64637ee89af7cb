"""Training metrics: JSON Lines logs written while training, read back, summarised and plotted.

A record is a flat dict with at least `worker`, `step`, `wall_s` and, for training steps, `loss`;
evaluations (every `train.eval_every` steps, and a run's last, `final`) add `val_loss`. Cumulative
counters `bytes_sent`, `bytes_received` and `wait_s` are optional; a sync's step may name the member that held
its average up longest, `held_by`, and by how many seconds, `held_s` (decentral.swarm.averaging.held_up).
A log can pass every record on to a sink as well: `TensorBoardSink` (the `tensorboard` extra, imported
only when one is made).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

SMOOTH_WINDOW = 10  # inner steps averaged for the plotted training loss
# what reports read
NUMBER_FIELDS = ("step", "loss", "val_loss", "wall_s", "bytes_sent", "bytes_received", "wait_s", "held_s")
CUMULATIVE_FIELDS = ("wall_s", "bytes_sent", "bytes_received", "wait_s")  # counted from a run's start, resumes too
FINAL_LOSS_WINDOW = 10  # last training losses averaged for the summary's final loss
TENSORBOARD_FLUSH_S = 5  # how stale the TensorBoard files may be (the JSONL is flushed after every record)
TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install 'decentral[tensorboard]'"


class MetricsError(Exception):
    """A metrics output cannot be written (its package is not installed), or a resumed run's metrics file cannot
    be read; the message says what to do."""


class MetricsSink(Protocol):
    """Where a MetricsLog passes each record on, after converting its values to plain Python ones."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """Appends one JSON object per line to `path`, flushed after each record.

    Opening drops a partial last line left by a writer that was killed mid-write, so that records
    appended by a resumed run stay readable. Each record also goes to `sink` when one is given; closing
    the log closes it.
    """

    def __init__(self, path: str | Path, sink: MetricsSink | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _repair_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self.sink = sink

    def write(self, **record: Any) -> None:
        """Log one record; values must be numbers, strings, bools or None (torch/numpy scalars are converted)."""
        plain = {key: _plain(value) for key, value in record.items()}
        self._file.write(json.dumps(plain) + "\n")
        self._file.flush()
        if self.sink is not None:
            self.sink.write(plain)

    def close(self) -> None:
        self._file.close()
        if self.sink is not None:
            self.sink.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorBoardSink:
    """Every number of a record as a TensorBoard scalar named by its key, at the record's `step`, in
    event files under `logdir`; strings, bools and None stay in the JSONL only."""

    def __init__(self, logdir: str | Path):
        self.writer = summary_writer_class()(str(logdir), flush_secs=TENSORBOARD_FLUSH_S)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


def summary_writer_class() -> type:
    """torch's SummaryWriter; MetricsError saying how to install it when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MetricsError(TENSORBOARD_MISSING) from None
    return SummaryWriter


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path_or_paths: str | Path | Iterable[str | Path]) -> list[dict]:
    """All records of one or more JSONL files, in file order.

    An unterminated, unparseable last line (a writer killed mid-line) is skipped; any other malformed
    line, or one whose field of NUMBER_FIELDS holds no number, raises ValueError naming `file:line`, and a file
    that is not UTF-8 text one naming the file.
    """
    paths = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    records = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").split("\n")  # last item: "" or an unterminated line
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {e.start}): not a metrics file") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if number == len(lines):
                    continue
                raise ValueError(f"{path}:{number}: malformed metrics line ({e.msg})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            wrong = [k for k in NUMBER_FIELDS if record.get(k) is not None and not _is_number(record[k])]
            if wrong:
                raise ValueError(f"{path}:{number}: {wrong[0]} is {record[wrong[0]]!r}, not a number")
            records.append(record)
    return records


def keep_records_until(path: str | Path, step: int) -> list[dict]:
    """Drop from the metrics file at `path` the records of steps after `step` (a run resumed at `step` writes
    them again, and a record without a step counts as step 0); the records kept ([] when there is no file).
    MetricsError naming the file and line when a record cannot be read (the file is left as it was)."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= step] if step >= 0 else []  # < 0: none to read
    except ValueError as e:  # (read_metrics names the file and line)
        raise MetricsError(f"{e}: a resumed run keeps its records up to its checkpoint and counts on from them; "
                           "mend that file, or move it aside to start a new one") from None
    path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    return kept


def counters_reached(records: Iterable[dict]) -> dict[str, float]:
    """The largest value each of CUMULATIVE_FIELDS reached in `records` (0 when none has it): where a resumed
    run counts on from."""
    records = list(records)
    return {k: max((r[k] for r in records if r.get(k) is not None), default=0) for k in CUMULATIVE_FIELDS}


def plot_report(records: list[dict], out_png: str | Path, title: str = "") -> Path:
    """Save a PNG with training loss (lightly smoothed) and validation loss per worker, vs step and vs wall time;
    a record without `step` or `wall_s` (a pipeline lead's first record after it took over has no wall time)
    is drawn in the other panel only."""
    from matplotlib.figure import Figure  # here, not at import: every worker imports this module, few plot

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    by_step, by_time = fig.subplots(1, 2)
    for index, (worker, rows) in enumerate(_by_worker(records).items()):
        colour = f"C{index % 10}"
        train = [r for r in rows if r.get("loss") is not None]
        val = [r for r in rows if r.get("val_loss") is not None]
        smooth = _moving_average([r["loss"] for r in train], SMOOTH_WINDOW)
        for ax, x in ((by_step, "step"), (by_time, "wall_s")):  # a record without x is left out of that panel
            shown = [(r[x], loss) for r, loss in zip(train, smooth) if r.get(x) is not None]
            if shown:
                ax.plot(*zip(*shown), color=colour, lw=1.2, label=f"{worker} train")
            shown = [(r[x], r["val_loss"]) for r in val if r.get(x) is not None]
            if shown:
                ax.plot(*zip(*shown), color=colour, ls="--", marker="o", ms=3, label=f"{worker} val")
    by_step.set(xlabel="inner step", ylabel="loss", title="loss vs step")
    by_time.set(xlabel="wall time (s)", ylabel="loss", title="loss vs wall time")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def check_picture_path(path: str | Path, option: str = "--out") -> None:
    """MetricsError unless matplotlib writes a picture to `path` (its suffix names the format) and it is no folder."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise MetricsError(f"{option} {path}: name a picture file ending in one of {', '.join(sorted(formats))}")
    if Path(path).is_dir():
        raise MetricsError(f"{option} {path} is a folder: give the picture's file name")


def write_report(records: list[dict], out_png: str | Path, title: str = "") -> dict[str, dict]:
    """`plot_report` into `out_png`, print the summary table; returns `summarize`'s result."""
    plot_report(records, out_png, title)
    summary = summarize(records)
    print(format_summary(summary), flush=True)
    return summary


def summarize(records: Iterable[dict]) -> dict[str, dict]:
    """Per worker, in order of first appearance: `final_step` (largest step), `final_loss` (mean of the
    last 10 training losses), `val_loss` (the last one), `bytes_sent`, `bytes_received` and `wait_s`
    (largest value of each cumulative counter), `wall_s` (the last one) and `held_up_s`: the seconds the workers'
    averages were held up by this worker (`held_s` where `held_by` names it), summed over every worker's records
    and divided by the number of workers. Absent values are None.
    """
    summary, by_worker = {}, _by_worker(records)
    held: dict[Any, float] = {}  # worker named by `held_by` -> the seconds of `held_s` naming it
    for rows in by_worker.values():
        for r in rows:
            if isinstance(r.get("held_by"), str) and r.get("held_s") is not None:
                held[r["held_by"]] = held.get(r["held_by"], 0.0) + r["held_s"]
    for worker, rows in by_worker.items():
        losses = [r["loss"] for r in rows if r.get("loss") is not None][-FINAL_LOSS_WINDOW:]
        summary[worker] = {
            "final_step": _largest(rows, "step"),
            "final_loss": sum(losses) / len(losses) if losses else None,
            "val_loss": _last(rows, "val_loss"),
            "bytes_sent": _largest(rows, "bytes_sent"),
            "bytes_received": _largest(rows, "bytes_received"),
            "wait_s": _largest(rows, "wait_s"),
            "wall_s": _last(rows, "wall_s"),
            "held_up_s": held.get(worker, 0.0) / len(by_worker) if held else None,
        }
    return summary


def format_summary(summary: dict[str, dict]) -> str:
    """A plain text table of `summarize`'s result, one row per worker; `-` marks absent values."""
    header = ("worker", "step", "loss", "val_loss", "sent", "received", "wait_s", "held_up_s", "wall_s")
    rows = [header] + [
        (
            str(worker), cell(s["final_step"], ""), cell(s["final_loss"], ".4f"),
            cell(s["val_loss"], ".4f"), human_bytes(s["bytes_sent"]), human_bytes(s["bytes_received"]),
            cell(s["wait_s"], ".1f"), cell(s["held_up_s"], ".1f"), cell(s["wall_s"], ".1f"),
        )
        for worker, s in summary.items()
    ]
    return format_table(rows)


def format_table(rows: list, numeric: bool = True) -> str:
    """Rows of strings as aligned text columns: the first column left-aligned, the others right-aligned
    (`numeric`) or left-aligned."""
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) if col and numeric else cell.ljust(w) for col, (cell, w) in enumerate(zip(row, widths)))
        .rstrip() for row in rows
    )


def check_no_earlier_results(out: Path, command: str, name: str = "results.json") -> None:
    """FileExistsError when `out` holds an earlier run's results file `name`, which `command` would write over."""
    if (Path(out) / name).is_file():
        raise FileExistsError(f"{command}: --out {out} holds an earlier run's {name}, which this run would write "
                              "over: give another --out")


@contextlib.contextmanager
def results_folder(out: Path, command: str, name: str = "results.json",
                   refuse: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Hold OUT (made when missing) while `command` writes its results there: `refuse(OUT)` raises when OUT holds
    an earlier run (by default: FileExistsError when it holds the results file `name`, `check_no_earlier_results`),
    before anything is written there and again once held; a second process given the same --out stops at once
    (`checkpoint.sole_writer`, CheckpointError)."""
    from decentral.checkpoint import sole_writer

    refuse = refuse or (lambda folder: check_no_earlier_results(folder, command, name))
    refuse(Path(out))
    Path(out).mkdir(parents=True, exist_ok=True)
    with sole_writer(out):
        refuse(Path(out))  # (a run given this --out may have ended meanwhile)
        yield Path(out)


def human_bytes(count: float | None) -> str:
    """`1536` -> `1.5 KiB`; None -> `-`."""
    if count is None:
        return "-"
    units = ("B", "KiB", "MiB", "GiB")
    power = 0
    while count >= 1024 and power < len(units) - 1:
        count /= 1024
        power += 1
    return f"{count:.0f} B" if power == 0 else f"{count:.1f} {units[power]}"


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return value.item()
    raise TypeError(f"metric values must be numbers, strings or None, not {type(value).__name__}")


def _repair_tail(path: Path) -> None:
    """Terminate an unterminated last line if it is a whole record, else cut it off."""
    with open(path, "a+b") as f:
        f.seek(0)
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        start = data.rfind(b"\n") + 1
        try:
            json.loads(data[start:])
        except ValueError:
            f.truncate(start)
        else:
            f.write(b"\n")


def _by_worker(records: Iterable[dict]) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = {}
    for record in records:
        groups.setdefault(record["worker"], []).append(record)
    return groups


def _moving_average(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (fewer at the start)."""
    sums = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _largest(rows: list[dict], key: str) -> Any:
    values = [r[key] for r in rows if r.get(key) is not None]
    return max(values) if values else None


def _last(rows: list[dict], key: str) -> Any:
    values = [r[key] for r in rows if r.get(key) is not None]
    return values[-1] if values else None


def cell(value: float | None, spec: str = "") -> str:
    """A table's cell: `value` formatted by `spec`, `-` for None."""
    return "-" if value is None else format(value, spec)
