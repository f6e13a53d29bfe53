"""Writing a user's output files: never over an existing file unless asked, and never half-written."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from layerdiff.errors import LayerdiffError


def refuse_existing(path, overwrite: bool, flag: str = "--force"):
    """One line for an output that would replace a file the user did not say could go."""
    if Path(path).exists() and not overwrite:
        raise LayerdiffError(f"{path} exists; pass {flag} to replace it")


@contextmanager
def atomic_output(path, *, overwrite: bool = False):
    """A binary file that replaces ``path`` only once the block completes: a failure (a full disk, a read-only
    directory, an exception) leaves the old file, if any, untouched and no partial file behind."""
    path = Path(path)
    refuse_existing(path, overwrite)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path, data: str | bytes, *, overwrite: bool = False):
    """``data`` (text as UTF-8) written through ``atomic_output``."""
    with atomic_output(path, overwrite=overwrite) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
