"""Metrics logs survive killed writers, and the summary and plot reflect the records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decentral.metrics import MetricsLog, format_summary, human_bytes, plot_report, read_metrics, summarize


def test_write_read_round_trip_converts_scalars(tmp_path):
    path = tmp_path / "run" / "w0" / "metrics.jsonl"  # parent folders are created
    with MetricsLog(path) as log:
        log.write(worker="w0", step=1, loss=torch.tensor(2.5), wall_s=np.float32(0.5), complete=True, note=None)
        log.write(worker="w0", step=np.int64(2), loss=torch.tensor([1.25]), wall_s=1.0)
    records = read_metrics(path)
    assert records == [
        {"worker": "w0", "step": 1, "loss": 2.5, "wall_s": 0.5, "complete": True, "note": None},
        {"worker": "w0", "step": 2, "loss": 1.25, "wall_s": 1.0},
    ]
    assert type(records[1]["step"]) is int


def test_records_are_flushed_before_close(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write(worker="w0", step=1)
    assert read_metrics(path) == [{"worker": "w0", "step": 1}]
    log.close()


def test_non_scalar_values_are_refused(tmp_path):
    with MetricsLog(tmp_path / "m.jsonl") as log, pytest.raises(TypeError):
        log.write(worker="w0", loss=torch.ones(3))


def test_reads_several_files_in_order(tmp_path):
    for name in ("a", "b"):
        with MetricsLog(tmp_path / f"{name}.jsonl") as log:
            log.write(worker=name, step=1)
    assert [r["worker"] for r in read_metrics([tmp_path / "a.jsonl", str(tmp_path / "b.jsonl")])] == ["a", "b"]


def test_trailing_partial_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def test_malformed_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path}:2"):
        read_metrics(path)


def test_a_file_that_is_not_utf8_text_is_named(tmp_path, capsys):
    """`decentral report` on such a file said only "'utf-8' codec can't decode byte ...", not which file."""
    from decentral.cli import main

    path = tmp_path / "w0" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"step": 1}\n\xff\xfe binary\n')
    with pytest.raises(ValueError, match=f"{path}: not UTF-8 text \\(byte 12\\): not a metrics file"):
        read_metrics(path)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and len(err.splitlines()) == 1, err


def test_a_record_whose_loss_or_step_is_no_number_names_file_and_line(tmp_path, capsys):
    """`decentral report` on it ended in a TypeError traceback from the summary's arithmetic."""
    from decentral.cli import main

    path = tmp_path / "w0" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": "2.4"}\n')
    with pytest.raises(ValueError, match=f"{path}:2: loss is '2.4', not a number"):
        read_metrics(path)
    path.write_text('{"step": true, "loss": 2.5}\n')
    with pytest.raises(ValueError, match=f"{path}:1: step is True, not a number"):
        read_metrics(path)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and len(err.splitlines()) == 1, err


def test_malformed_terminated_last_line_raises(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n')  # terminated, so not a write cut short
    with pytest.raises(ValueError, match=":2"):
        read_metrics(path)


def test_resumed_writer_drops_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    with MetricsLog(path) as log:
        log.write(step=2)
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def test_resumed_writer_keeps_whole_unterminated_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    with MetricsLog(path) as log:
        log.write(step=3)
    assert read_metrics(path) == [{"step": 1}, {"step": 2}, {"step": 3}]


def _records() -> list[dict]:
    """Two workers; w1 has no traffic counters; validation every 5 steps; a final record without loss."""
    records = []
    for worker, speed in (("w0", 0.1), ("w1", 0.15)):
        for step in range(1, 26):
            record = {"worker": worker, "step": step, "loss": 5.0 / step + speed, "wall_s": step * speed}
            if worker == "w0":
                record.update(bytes_sent=1000 * (step // 5), bytes_received=900 * (step // 5), wait_s=0.01 * step)
            if step % 5 == 0:
                record["val_loss"] = 6.0 / step
            records.append(record)
        records.append({"worker": worker, "step": 25, "val_loss": 0.2, "final": True, "wall_s": 26 * speed})
    return records


def test_summarize_final_numbers():
    records = _records()
    summary = summarize(records)
    assert list(summary) == ["w0", "w1"]
    for worker, s in summary.items():
        mine = [r for r in records if r["worker"] == worker]
        last_losses = [r["loss"] for r in mine if "loss" in r][-10:]
        assert s["final_step"] == 25
        assert s["final_loss"] == pytest.approx(sum(last_losses) / 10)
        assert s["val_loss"] == 0.2  # the final record's
        assert s["wall_s"] == mine[-1]["wall_s"]
    w0 = [r for r in records if r["worker"] == "w0" and "bytes_sent" in r]
    assert summary["w0"]["bytes_sent"] == 1000 * (25 // 5)
    assert summary["w0"]["bytes_received"] == max(r["bytes_received"] for r in w0)
    assert summary["w0"]["wait_s"] == pytest.approx(0.01 * 25)
    assert summary["w1"]["bytes_sent"] is None and summary["w1"]["wait_s"] is None


def test_format_summary_table():
    summary = summarize(_records())
    summary["w0"]["bytes_sent"] = 3 * 2**20
    lines = format_summary(summary).splitlines()
    assert lines[0].split() == ["worker", "step", "loss", "val_loss", "sent", "received", "wait_s", "held_up_s",
                                "wall_s"]
    assert lines[1].startswith("w0") and "3.0 MiB" in lines[1] and "4.4 KiB" in lines[1]
    assert lines[2].startswith("w1") and lines[2].split()[4:6] == ["-", "-"]
    assert f"{summary['w1']['final_loss']:.4f}" in lines[2]


def test_held_up_seconds_are_those_every_workers_averages_waited_for_it_per_worker():
    """Three workers' syncs: w2's own records name w2 (its parts reached the others last), w0's name w2 too, w1's
    name w0 once; the seconds are summed per worker named and divided by the three workers."""
    records = [{"worker": "w0", "step": 1, "loss": 1.0, "held_by": "w2", "held_s": 2.0},
               {"worker": "w0", "step": 2, "loss": 1.0, "held_by": "w2", "held_s": 1.0},
               {"worker": "w1", "step": 1, "loss": 1.0, "held_by": "w0", "held_s": 0.3},
               {"worker": "w1", "step": 2, "loss": 1.0},
               {"worker": "w2", "step": 1, "loss": 1.0, "held_by": "w2", "held_s": 3.0}]
    summary = summarize(records)
    assert summary["w2"]["held_up_s"] == pytest.approx((2.0 + 1.0 + 3.0) / 3)
    assert summary["w0"]["held_up_s"] == pytest.approx(0.3 / 3)
    assert summary["w1"]["held_up_s"] == 0.0
    assert summarize(_records())["w0"]["held_up_s"] is None  # no record times its averages: unknown, not 0
    odd = summarize([*records, {"worker": "w1", "step": 3, "loss": 1.0, "held_by": ["w2"], "held_s": 9.0}])
    assert odd["w2"]["held_up_s"] == summary["w2"]["held_up_s"]  # a hand-edited name that is no name: not counted


@pytest.mark.parametrize(
    ("count", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"), (2**31, "2.0 GiB")]
)
def test_human_bytes(count, text):
    assert human_bytes(count) == text


def test_plot_report_writes_png(tmp_path):
    out = plot_report(_records(), tmp_path / "plots" / "report.png", title="noloco, 2 workers")
    assert out == tmp_path / "plots" / "report.png"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_plot_report_after_reading_a_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for r in _records():
            log.write(**r)
    out = plot_report(read_metrics(path), tmp_path / "report.png")
    assert out.read_bytes().startswith(b"\x89PNG")
