"""Checkpoint formats, each read one tensor at a time where the format allows: ``Checkpoint`` and its readers.

Framework libraries are imported only by the reader that needs them. Nothing is unpickled beyond tensors and
plain containers (see the package docstring for each format's rule).
"""
from __future__ import annotations

import hashlib
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from layerdiff import errors
from layerdiff.checkpoints import safetensors_io
from layerdiff.errors import LayerdiffError


def first_line(exc: BaseException) -> str:
    return errors.first_line(exc, 300)


# ---------------------------------------------------------------------------------------------- base class
class Checkpoint:
    """A name -> tensor view of a checkpoint. Subclasses fill ``_index`` (name -> (dtype, shape)) and ``_load``."""

    format = "?"
    whole = False  # True: the loader holds the whole checkpoint in memory once it is read

    def __init__(self, path):
        self.path = Path(path)
        self._index: dict = {}
        self.notes: list = []
        self.spill_file: Path | None = None  # a temporary file its tensors were moved into (removed after use)

    def names(self) -> list:
        return list(self._index)

    def info(self, name: str) -> tuple:
        return self._index[name]

    def load(self, name: str) -> tuple:
        return self._load(name)

    def _load(self, name):
        raise NotImplementedError

    def close(self):
        pass

    def describe(self) -> str:
        return f"{self.path} ({self.format}, {len(self._index)} tensors)"


class InMemory(Checkpoint):
    """Values already in memory: name -> (array, dtype)."""

    whole = True

    def __init__(self, path, fmt, tensors: dict):
        super().__init__(path)
        self.format = fmt
        self._tensors = tensors
        self._index = {k: (d, [int(s) for s in a.shape]) for k, (a, d) in tensors.items()}

    def _load(self, name):
        return self._tensors[name]

    def close(self):
        self._tensors = {}


# ------------------------------------------------------------------------------------------- safetensors
class SafetensorsFiles(Checkpoint):
    format = "safetensors"

    def __init__(self, path, files):
        super().__init__(path)
        self._where: dict[str, tuple] = {}
        for file in files:
            for name, entry in safetensors_io.read_header(file)[0].items():
                if name in self._where:
                    raise LayerdiffError(f"{file}: tensor {name!r} also appears in another shard")
                self._where[name] = (file,) + entry
                self._index[name] = (entry[0], entry[1])

    def _load(self, name):
        file, dtype, shape, start, nbytes = self._where[name]
        dt = np.dtype(safetensors_io.storage_dtype(dtype))
        try:
            with open(file, "rb") as f:
                f.seek(start)
                raw = f.read(nbytes)
        except OSError as exc:
            raise LayerdiffError(f"{file}: cannot read ({exc.strerror or exc})") from None
        if len(raw) != nbytes:
            raise LayerdiffError(f"{file}: tensor {name!r} is truncated")
        return np.frombuffer(raw, dtype=dt).reshape(shape), dtype


# --------------------------------------------------------------------------------------------------- npz
class NpzFile(Checkpoint):
    format = "npz"

    def __init__(self, path):
        super().__init__(path)
        try:
            self._npz = np.load(path, allow_pickle=False)
            if not hasattr(self._npz, "files"):
                raise LayerdiffError(f"{path}: a single .npy array, not an .npz archive")
            for name in self._npz.files:  # headers only; data is read on load
                self._index[name] = None
        except LayerdiffError:
            raise
        except Exception as exc:
            raise LayerdiffError(f"{path}: not a readable .npz file ({first_line(exc)})") from None

    def info(self, name):
        if self._index[name] is None:
            arr, dtype = self._load(name)
            self._index[name] = (dtype, list(arr.shape))
        return self._index[name]

    def _load(self, name):
        try:
            arr = self._npz[name]
        except Exception as exc:
            raise LayerdiffError(f"{self.path}: member {name!r} unreadable ({first_line(exc)})") from None
        dtype = str(arr.dtype)
        if dtype == "object" or dtype not in safetensors_io.STORABLE_DTYPES and dtype not in ("complex64", "complex128"):
            raise LayerdiffError(f"{self.path}: member {name!r} has unsupported dtype {dtype}")
        return arr, dtype

    def close(self):
        self._npz.close()


# ------------------------------------------------------------------------------------------------- torch
def torch_stored(t):
    from layerdiff.adapters import load_adapter

    return load_adapter("torch").to_stored(t)


_MAX_NESTING = 64  # real checkpoints nest dicts a few levels ({"model": {"module": state_dict}})


def flatten(obj, prefix, out, is_tensor, skipped, source="checkpoint"):
    """Nested dicts -> ``out`` {dotted name: tensor}, in order; other leaves' names go to ``skipped``. Iterative
    and at most ``_MAX_NESTING`` levels deep: a hostile (deep or cyclic) pickle is one error naming ``source``."""
    stack = [(obj, prefix, 0)]
    while stack:
        obj, prefix, depth = stack.pop()
        if isinstance(obj, dict):
            if depth >= _MAX_NESTING:
                raise LayerdiffError(f"{source}: dictionaries nested more than {_MAX_NESTING} levels deep (cyclic?)")
            try:
                children = [(v, f"{prefix}.{k}" if prefix else str(k), depth + 1) for k, v in obj.items()]
            except ValueError:  # a key that is an integer too long to print
                raise LayerdiffError(f"{source}: a dictionary key cannot be turned into a name") from None
            stack.extend(reversed(children))
        elif is_tensor(obj):
            out[prefix] = obj
        elif prefix:
            skipped.append(prefix)


def torch_load(path, extra_globals=()):
    """``torch.load(weights_only=True)``, mmap'ed when possible; refuses anything else."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise LayerdiffError(f"{path}: no such file")

    def attempt(mmap):
        with torch.serialization.safe_globals(list(extra_globals)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            return attempt(True), True
        except pickle.UnpicklingError:
            raise
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc):
                raise
            return attempt(False), False
    except pickle.UnpicklingError as exc:
        detail = re.search(r"(GLOBAL \S+|Unsupported operand \S+)", str(exc))
        raise LayerdiffError(f"{path}: refused: the pickle needs more than tensors "
                             f"({detail.group(1).rstrip('.,;') if detail else 'not a weights-only checkpoint'}); "
                             "layerdiff never loads checkpoints unsafely") from None
    except Exception as exc:
        raise LayerdiffError(f"{path}: not a readable PyTorch checkpoint ({first_line(exc)})") from None


class TorchFile(Checkpoint):
    format = "torch"

    def __init__(self, path, obj=None, mmapped=None):
        super().__init__(path)
        import torch
        if obj is None:
            obj, mmapped = torch_load(path)
        self.whole = not mmapped
        skipped: list[str] = []
        self._tensors: dict[str, Any] = {}
        flatten(obj, "", self._tensors, lambda x: isinstance(x, torch.Tensor), skipped, source=path)
        if not self._tensors:
            raise LayerdiffError(f"{path}: no tensors in this PyTorch file")
        from layerdiff.adapters import load_adapter

        torch_adapter = load_adapter("torch")
        for name, t in self._tensors.items():
            dtype = torch_adapter.dtype_name(t)
            if dtype is None:
                raise LayerdiffError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
            self._index[name] = (dtype, list(t.shape))

    def _load(self, name):
        return torch_stored(self._tensors[name])

    def close(self):
        self._tensors = {}


# ------------------------------------------------------------------------------------------------ paddle
_NUMPY_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                  ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "scalar"), ("collections", "OrderedDict")}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def load_pdparams(path) -> InMemory:
    path = Path(path)
    if not path.is_file():
        raise LayerdiffError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            obj = _RestrictedUnpickler(f, encoding="latin1").load()
    except pickle.UnpicklingError as exc:
        raise LayerdiffError(f"{path}: refused: not a plain dict of arrays ({first_line(exc)}); "
                             "layerdiff never unpickles arbitrary objects") from None
    except Exception as exc:
        raise LayerdiffError(f"{path}: not a readable .pdparams file ({first_line(exc)})") from None
    if not isinstance(obj, dict):
        raise LayerdiffError(f"{path}: a .pdparams file should hold a dict of arrays, not {type(obj).__name__}")
    tensors: dict = {}
    skipped: list = []
    flatten({k: v for k, v in obj.items() if k != "StructuredToParameterName@@"}, "", tensors,
             lambda x: isinstance(x, np.ndarray), skipped, source=path)
    out = {}
    for name, arr in tensors.items():
        if arr.dtype == object:
            raise LayerdiffError(f"{path}: {name!r} is an object array")
        out[name] = (arr, str(arr.dtype))
    if not out:
        raise LayerdiffError(f"{path}: no arrays in this .pdparams file")
    return InMemory(path, "paddle", out)


# --------------------------------------------------------------------------------------------- mindspore
def load_ms_ckpt(path) -> InMemory:
    path = Path(path)
    if not path.is_file():
        raise LayerdiffError(f"{path}: no such file")
    try:
        import mindspore as ms
        params = ms.load_checkpoint(str(path))
    except Exception as exc:
        raise LayerdiffError(f"{path}: not a readable MindSpore checkpoint ({first_line(exc)})") from None
    from layerdiff.adapters import load_adapter

    mindspore_adapter = load_adapter("mindspore")
    out = {}
    for name, p in params.items():
        stored = mindspore_adapter.to_stored(p)
        if stored is None:
            raise LayerdiffError(f"{path}: parameter {name!r} has an unsupported dtype")
        out[name] = (np.array(stored[0], copy=True), stored[1])
    return InMemory(path, "mindspore", out)


# ------------------------------------------------------------------------------------------------- trace
class TraceParams(Checkpoint):
    format = "layerdiff trace"

    def __init__(self, path, step="first"):
        super().__init__(path)
        from layerdiff.tracefile.reader import open_trace
        self._reader = open_trace(path)
        records = [r for r in self._reader.records if r.kind == "param" and r.tensors]
        damage = self._reader.damage
        if not records:
            crashed = self._reader.crashed
            self._reader.close()
            raise LayerdiffError(f"{path}: this trace holds no parameter values" + (
                f" ({len(damage)} damaged: {damage[0].describe()})" if damage else
                " (its index ends early: the writing process died)" if crashed else ""))
        self.notes += [f"DAMAGED {path}: {d.describe()} (a parameter it held is missing here)" for d in damage]
        steps = sorted({r.step for r in records})
        chosen = steps[0] if step == "first" else steps[-1]
        self._entries = {}
        for r in records:
            if r.step == chosen:
                t = r.tensors[0]
                self._entries[r.path] = t
                self._index[r.path] = (t.dtype, list(t.shape))

    def _load(self, name):
        t = self._entries[name]
        return self._reader.tensor(t), t.dtype

    def close(self):
        self._reader.close()


def file_digest(path) -> str:
    """SHA-256 of a file; for a folder, of each file's relative path and contents in sorted order."""
    path = Path(path)
    if not path.exists():
        raise LayerdiffError(f"{path}: no such file or folder")
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if path.is_dir():
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


