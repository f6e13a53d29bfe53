"""User-facing errors: the CLI prints their message as one line and exits 2."""
from __future__ import annotations


class LayerdiffError(Exception):
    """A problem with the user's input (file, flag, trace) rather than a bug in layerdiff."""


class TraceFormatError(LayerdiffError):
    """A file that is missing, not HDF5, not a layerdiff trace, or damaged."""


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when it has none), at most ``limit`` characters:
    what a one-line error quotes of a library's exception."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if limit is None else line[:limit]
