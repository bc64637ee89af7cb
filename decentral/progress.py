"""How far long work is: tqdm's bar on a terminal; elsewhere (a log, a pipe, a scheduler's output file),
where a bar would be a stream of carriage returns, one line at each tenth of the work done (at most one a second
between the first and the last: work of a few seconds says little)."""

from __future__ import annotations

import sys
from time import monotonic
from typing import TextIO

from tqdm import tqdm


class _TenthLines(tqdm):
    """A tqdm whose display is one line, "DESC: N of TOTAL UNIT" ("DESC: 300kB of 1.59MB" with `unit_scale`), when
    the work crosses a tenth of `total`, `MIN_GAP_S` after the line before it (the first and the last line always)."""

    MIN_GAP_S = 1.0

    def __init__(self, *args, **kwargs):
        self._said, self._said_at = -1, 0.0
        super().__init__(*args, mininterval=0, miniters=1, **kwargs)
        self.sp = None  # no status line to clear or end with a newline on close (tqdm's own display is not used)

    def display(self, msg=None, pos=None) -> bool:
        if not self.total or self.n * 10 // self.total <= self._said:
            return True
        if self._said >= 0 and self.n < self.total and monotonic() - self._said_at < self.MIN_GAP_S:
            return True  # (a later update says where it is then)
        self._said, self._said_at = self.n * 10 // self.total, monotonic()
        if self.unit_scale:  # "300kB of 1.59MB": the unit on each size
            n, total = (self.format_sizeof(v, self.unit) if v else f"0{self.unit}" for v in (self.n, self.total))
            unit = ""
        else:
            n, total, unit = self.n, self.total, self.unit
        print(f"{self.desc}: {n} of {total} {unit}".rstrip(), file=self.fp, flush=True)
        return True

    def close(self) -> None:
        if not self.disable:
            self._said_at = -self.MIN_GAP_S
            self.display()  # the end (or where it stopped), when the last update did not say it
        super().close()


def progress_bar(total: int, desc: str, unit: str = "it", *, file: TextIO | None = None, **kwargs) -> tqdm:
    """A tqdm bar of `total` on `file` (stderr by default) when it is a terminal, else tenth lines (`_TenthLines`;
    sizes scaled with `unit_scale=True`). Other keywords go to tqdm."""
    file = file or sys.stderr
    if file.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=file, **kwargs)
    return _TenthLines(total=total, desc=desc, unit=unit, file=file, **kwargs)
