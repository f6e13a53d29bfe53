"""Progress shown on a terminal while a command works (never when piped or quiet): bytes compared, steps traced,
bisect runs."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class ByteProgress:
    """A rich progress bar over bytes, shown only on a terminal and when not quiet."""

    def __init__(self, description: str, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.description = description
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def _columns(self) -> tuple:
        from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn

        return BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()

    def start(self, total: int):
        if not self.enabled or total <= 0:
            return
        from rich.progress import Progress

        bar = Progress("[progress.description]{task.description}", *self._columns(), console=Console(stderr=True),
                       transient=True)
        bar.start()
        self._task = bar.add_task(self.description, total=total)
        self._bar = bar

    def advance(self, n: int):
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)

    def close(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class TaskProgress(ByteProgress):
    """The same bar over tasks done (the rank pairs of ``align RUN``, wherever they run)."""

    def _columns(self) -> tuple:
        from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn, TimeRemainingColumn

        return BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()


class StepProgress:
    """Steps done, records and bytes written, while ``layerdiff trace`` runs (terminal only)."""

    def __init__(self, steps: int, enabled: bool | None = None):
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress("tracing", BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[written]}"),
                           TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            bar.start()
            self._task = bar.add_task("steps", total=steps, written="")
            self._bar = bar

    def advance(self, writer):
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=1,
                             written=f"{writer.records_written} records, {writer.tensor_bytes / 1e6:.1f} MB")

    def close(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class RunProgress:
    """``layerdiff bisect``: a bar over the runs (each is a whole step of the candidate) with the current one's
    label on a terminal; one line per run otherwise, so logs show how far an interrupted bisect got."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self.started = 0

    def expect(self, runs: int):
        """The number of runs this bisect will take (the binary search knows it once it has found the blocks)."""
        if not self.enabled or not self.console.is_terminal:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self._bar is None or self._task is None:
            bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           console=self.console, transient=True)
            bar.start()
            self._task = bar.add_task("bisect", total=runs)
            self._bar = bar
        else:
            self._bar.update(self._task, total=runs)

    def __call__(self, message: str, start: bool = False):
        if not self.enabled:
            return
        if start:
            self.started += 1
            message = f"run {self.started}: {message}"
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=message, advance=0 if start else 1)
        self.console.print(f"[dim]{message}[/]", highlight=False)

    def close(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
