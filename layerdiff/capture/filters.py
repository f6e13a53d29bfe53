"""Which modules a trace records: include/exclude regular expressions on module paths, and a window of blocks."""
from __future__ import annotations

import re

from layerdiff.match.modules import find_blocks


def parse_layers(text: str) -> tuple[int, int]:
    """``START:END`` (END exclusive, like a Python slice) or ``N`` (just block N)."""
    start, colon, end = text.partition(":")
    try:
        first = int(start)
        last = int(end) if colon else first + 1
    except ValueError:
        raise ValueError(f"--layers {text!r}: expected START:END or N (block indices)") from None
    if first < 0 or last <= first:
        raise ValueError(f"--layers {text!r}: expected 0 <= START < END")
    return first, last


class PathFilter:
    """Include/exclude module paths by regular expression (``re.search``), and a window of blocks by index.

    ``layers=(start, end)`` keeps blocks start..end-1 of the model's main module list (``model.layers``) and
    their submodules: the second pass of two-pass tracing. Made for one model: ``paths`` are its module paths
    (the model itself first, as ''), against which the window is resolved and the filters are checked.
    """

    def __init__(self, paths, include=None, exclude=None, layers=None, strict: bool = True):
        self.include = [_compile(p, "--include") for p in _as_list(include)]
        self.exclude = [_compile(p, "--exclude") for p in _as_list(exclude)]
        self.layers = tuple(layers) if layers is not None else None
        self.window: list | None = None
        self.window_paths: list[str] = []
        self._bind(list(paths), strict)  # strict: a filter that keeps no module is an error (bisect's probes allow it)

    @classmethod
    def of(cls, options, paths) -> PathFilter:
        """The filter a trace's options ask for, on a model of module ``paths``."""
        return cls(paths, options.include, options.exclude, options.layers, options.strict_filters)

    def _bind(self, paths: list, strict: bool):
        if strict and (self.include or self.exclude):  # keeping no module is a mistake, not an empty trace
            if not any(self(p) for p in paths if p):
                flags = " ".join([f"--include {p.pattern!r}" for p in self.include]
                                 + [f"--exclude {p.pattern!r}" for p in self.exclude])
                raise ValueError(f"{flags} keeps none of the model's {len(paths) - 1} modules (e.g. "
                                 f"{', '.join(p for p in paths[1:4] if p)})")
        if self.layers is None:
            return
        container, blocks = find_blocks(paths)
        start, end = self.layers
        if not blocks or end > len(blocks):
            raise ValueError(f"--layers {start}:{end}: the model has {len(blocks)} numbered blocks"
                             + (f" (in {container})" if blocks else ""))
        self.window_paths = blocks[start:end]
        self.window = [re.compile(rf"^{re.escape(b)}(\.|$)") for b in self.window_paths]

    def __call__(self, path: str) -> bool:
        if self.window is not None and not any(p.search(path) for p in self.window):
            return False
        if self.include and not any(p.search(path) for p in self.include):
            return False
        return not any(p.search(path) for p in self.exclude)


def _compile(pattern: str, flag: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"bad {flag} regular expression {pattern!r}: {exc}") from None


def _as_list(x):
    if x is None:
        return []
    return [x] if isinstance(x, str) else list(x)
