"""decentral.progress where no terminal shows a bar (a log, a pipe): a line at each tenth of the work, at most one
a second between the first and the last (a 1.5 MB merge wrote eleven lines)."""

import io

from decentral import progress
from decentral.progress import progress_bar


class Log(io.StringIO):
    def isatty(self) -> bool:
        return False


def lines_of(work, monkeypatch) -> list[str]:
    """The lines of a bar of 10 units, each unit taking `work[i]` seconds of a fake clock."""
    clock = [0.0]
    monkeypatch.setattr(progress, "monotonic", lambda: clock[0])
    log = Log()
    with progress_bar(10, "job", file=log) as bar:
        for seconds in work:
            clock[0] += seconds
            bar.update(1)
    return log.getvalue().splitlines()


def test_fast_work_says_where_it_starts_and_ends(monkeypatch):
    assert lines_of([0.01] * 10, monkeypatch) == ["job: 0 of 10 it", "job: 10 of 10 it"]


def test_slow_work_says_each_tenth(monkeypatch):
    assert lines_of([2.0] * 10, monkeypatch) == [f"job: {n} of 10 it" for n in range(11)]


def test_a_tenth_within_a_second_of_the_line_before_is_said_by_the_next_update(monkeypatch):
    assert lines_of([0.6] * 10, monkeypatch) == ["job: 0 of 10 it", "job: 2 of 10 it", "job: 4 of 10 it",
                                                 "job: 6 of 10 it", "job: 8 of 10 it", "job: 10 of 10 it"]


def test_work_that_stops_early_says_where_it_stopped(monkeypatch):
    assert lines_of([0.01] * 4, monkeypatch) == ["job: 0 of 10 it", "job: 4 of 10 it"]
