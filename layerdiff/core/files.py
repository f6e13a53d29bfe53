"""Writing a user's output files: never over an existing file unless asked, and never half-written."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import LayerdiffError


def refuse_existing(path, overwrite: bool, flag: str = "--force"):
    """One line for an output that would replace a file the user did not say could go."""
    if Path(path).exists() and not overwrite:
        raise LayerdiffError(f"{path} exists; pass {flag} to replace it")


def write_atomically(path, data: str | bytes, *, overwrite: bool = False):
    """Write through a temporary file renamed into place: a failure (a full disk, a read-only directory)
    leaves the old file, if any, untouched and no partial file behind."""
    path = Path(path)
    refuse_existing(path, overwrite)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None
