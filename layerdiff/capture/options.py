"""How a trace is taken: the options of ``layerdiff.trace`` and ``layerdiff trace``, checked once, as one object
that the tracer, the session, the writer and the hooks read."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from layerdiff.errors import LayerdiffError

MODES = ("full", "stats")
WRITE_BEHIND_MB = 256  # tensor data a full trace may hold in memory while the disk catches up
HELD_RECORDS = 256  # records whose lines the writer may hold to write together (``TraceWriter``'s held_records)
Patterns = Union[str, Sequence[str], None]  # one regular expression or several, as given


@dataclass(frozen=True)
class TraceOptions:
    """``mode`` "full" (values and statistics) or "stats"; ``backward`` taps gradients; ``include``/``exclude``
    module-path regexes; ``layers`` (start, end) keeps blocks start..end-1 of the model's main module list;
    ``params`` records parameter values and gradients; ``compression`` None, "gzip" or "lzf"; ``flush_interval``
    seconds: how long a record may wait in memory (0: none waits); ``write_behind`` MB of tensor bytes a writer
    thread may hold (None: 256 in full mode, 0 in stats mode), and 0 also writes each record before the step goes
    on (otherwise up to ``HELD_RECORDS`` are held and written together); ``overwrite`` replaces an existing file;
    ``meta`` the user's notes. ``strict_filters`` refuses filters that keep no module and ``one_process`` a run
    spread over ranks (bisect's own runs). ``ops`` records the operations inside module calls: True in every
    module, or patterns for the modules to record them in (``include``'s matching: a module and everything inside
    it)."""

    mode: str = "full"
    backward: bool = True
    include: Patterns = None
    exclude: Patterns = None
    layers: Optional[tuple[int, ...]] = None
    params: bool = True
    compression: Optional[str] = None
    flush_interval: float = 1.0
    write_behind: Optional[float] = None
    overwrite: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    strict_filters: bool = True
    one_process: bool = False
    ops: Union[bool, str, Sequence[str]] = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise LayerdiffError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        behind = self.write_behind
        if not (isinstance(behind, (int, float)) and 0 <= behind < 2**20) and behind is not None:
            raise LayerdiffError(f"write_behind must be a number of MB >= 0 (0: every record is in the file before "
                                 f"the step goes on), not {behind!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
        if isinstance(self.ops, str):
            object.__setattr__(self, "ops", (self.ops,))
        elif not isinstance(self.ops, bool):
            if not all(isinstance(p, str) for p in self.ops):
                raise LayerdiffError(f"ops must be True or module-path patterns (strings), not {self.ops!r}")
            object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "meta", dict(self.meta or {}))

    @property
    def write_behind_mb(self) -> float:
        """The ring's size in MB: as given, else 256 in full mode (0 in stats mode: nothing to write behind)."""
        if self.write_behind is not None:
            return self.write_behind
        return WRITE_BEHIND_MB if self.mode == "full" else 0

    @property
    def held_records(self) -> int:
        """How many records the writer may hold: none where the user asked for every record in the file before
        the step goes on (``write_behind=0`` or ``flush_interval=0``)."""
        return 0 if self.write_behind == 0 or self.flush_interval == 0 else HELD_RECORDS

    def recorded(self) -> dict[str, Any]:
        """The options as the trace's metadata keeps them (``meta["options"]``, read back by bisect)."""
        return dict(mode=self.mode, backward=self.backward, include=self.include, exclude=self.exclude,
                    compression=self.compression, flush_interval=self.flush_interval, params=self.params,
                    layers=list(self.layers) if self.layers is not None else None,
                    write_behind=self.write_behind_mb, ops=self.ops if isinstance(self.ops, bool) else list(self.ops))


def check_flush_interval(value: object) -> None:
    """A finite number of seconds >= 0 (the CLI's flag and the writer share this check)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise LayerdiffError(f"flush interval must be a finite number of seconds >= 0, not {value!r}")
