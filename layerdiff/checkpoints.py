"""Checkpoint-to-checkpoint weight comparison: ``layerdiff weights diff A B``.

``open_checkpoint(path)`` returns a ``Checkpoint`` with ``names()``, ``info(name) -> (dtype, shape)`` and
``load(name) -> (numpy array of stored bits, dtype name)`` (bfloat16/float8 travel as their bits, as everywhere
in layerdiff). ``diff(a, b)`` compares two of them parameter by parameter; ``run(args)`` is the CLI command.

Formats and how they are read (framework libraries are imported only by the loader that needs them):

- ``.safetensors`` and Hugging Face folders (``model.safetensors``, ``model.safetensors.index.json`` shards):
  streamed, one tensor at a time, by offsets from the validated header. Nothing is unpickled.
- ``.npz``: ``np.load(allow_pickle=False)``; members are read lazily, one at a time.
- layerdiff trace ``.h5``: its ``param`` records (the values at step 0, or at the last step with
  ``param_step="last"``), read one tensor at a time.
- PyTorch ``.pt``/``.bin`` (and ``pytorch_model.bin`` folders): ``torch.load(weights_only=True)`` with
  ``mmap=True`` where the file is a zip checkpoint (then tensors are paged in on use, not held in memory);
  legacy (non-zip) files are loaded whole. A pickle that needs anything beyond tensors and plain containers
  is refused (never re-loaded unsafely). Nested dicts (``{"model": state_dict}``) are flattened with dots.
- Paddle ``.pdparams``: these are *pickles*, and ``paddle.load`` unpickles them with the stock unpickler, so
  a malicious file would run code. We therefore never call ``paddle.load``: a restricted unpickler accepts
  only dicts/OrderedDicts of numpy arrays (numpy's array-reconstruction globals), refusing any other global.
  Loaded whole. Paddle saves bfloat16 as uint16 arrays, so such tensors show as uint16.
- MindSpore ``.ckpt``: ``mindspore.load_checkpoint`` (protobuf, not pickle), loaded whole.
- Megatron-LM folders: a root holding ``latest_checkpointed_iteration.txt`` (that iteration is used) or an
  ``iter_XXXXXXX`` folder, with ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files. Read with
  ``weights_only=True`` (``argparse.Namespace`` and numpy's array rebuild allowed, for Megatron's stored
  ``args`` and numpy RNG state; anything else, e.g. TransformerEngine extra state objects, is refused with a
  clear message). The model
  state is ``"model"`` (or ``"model0"``, ``"model1"``... for virtual pipeline stages, prefixed ``model0.``...).
  Merging (see ``megatron_partition_dim``): tensor-parallel shards are concatenated by parameter name:
  column-parallel (qkv / linear_qkv / query_key_value, fc1 / dense_h_to_4h / linear_fc1, word_embeddings,
  output_layer, q/k/v/gate/up_proj, lm_head: weight *and* bias) on dim 0; row-parallel (self_attention.dense
  / linear_proj / proj, fc2 / dense_4h_to_h / linear_fc2, o_proj, down_proj: weight only) on dim 1;
  everything else (norms, biases of row-parallel layers, rotary buffers...) is replicated and taken from
  TP rank 0. Anything whose name contains "norm" is replicated. Pipeline ranks hold different layers with
  local indices, so ``layers.N`` of PP rank p is renumbered by the layer count of ranks < p; other names found
  on several PP ranks (tied embeddings) are taken from the first. Note: a GLU fc1 ([gate; up] per rank) merges
  as [g0; u0; g1; u1], which matches another checkpoint of the same TP size, not a TP=1 one.

Memory: streamed formats never hold a whole checkpoint. Whole-loaded formats (legacy torch, pdparams,
MindSpore, Megatron's per-rank files when not mmap-able) hold one checkpoint at a time: when *both* sides are
whole-loaded, ``diff`` spills side A to a temporary safetensors file and frees it before loading B.

Security: checkpoints from untrusted sources should be verified first (``file_digest``, ``--sha256``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import pickle
import re
import tempfile
import warnings
from pathlib import Path, PurePosixPath

import numpy as np

from .core import modules, paramplan, safetensors_io
from .core.layouts import canonical_param_name
from .core.mapping import match_modules
from .core.match import RenameRules
from .core.paramplan import ParamSource
from .core.rules import RuleSet, ruleset
from .core.tensors import summarize
from .errors import LayerdiffError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


# ---------------------------------------------------------------------------------------------- base class
class Checkpoint:
    """A name -> tensor view of a checkpoint. Subclasses fill ``_index`` (name -> (dtype, shape)) and ``_load``."""

    format = "?"
    whole = False  # True: the loader holds the whole checkpoint in memory once it is read

    def __init__(self, path):
        self.path = Path(path)
        self._index: dict = {}
        self.notes: list = []

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


class _InMemory(Checkpoint):
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
class _Safetensors(Checkpoint):
    format = "safetensors"

    def __init__(self, path, files):
        super().__init__(path)
        self._where = {}
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
class _Npz(Checkpoint):
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
            raise LayerdiffError(f"{path}: not a readable .npz file ({_first_line(exc)})") from None

    def info(self, name):
        if self._index[name] is None:
            arr, dtype = self._load(name)
            self._index[name] = (dtype, list(arr.shape))
        return self._index[name]

    def _load(self, name):
        try:
            arr = self._npz[name]
        except Exception as exc:
            raise LayerdiffError(f"{self.path}: member {name!r} unreadable ({_first_line(exc)})") from None
        dtype = str(arr.dtype)
        if dtype == "object" or dtype not in safetensors_io._TO_ST and dtype not in ("complex64", "complex128"):
            raise LayerdiffError(f"{self.path}: member {name!r} has unsupported dtype {dtype}")
        return arr, dtype

    def close(self):
        self._npz.close()


# ------------------------------------------------------------------------------------------------- torch
def _torch_stored(t):
    from .adapters.torch_adapter import to_stored
    return to_stored(t)


_MAX_NESTING = 64  # real checkpoints nest dicts a few levels ({"model": {"module": state_dict}})


def _flatten(obj, prefix, out, is_tensor, skipped, source="checkpoint"):
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


def _megatron_globals() -> tuple:
    """What Megatron's model_optim_rng.pt pickles besides tensors: its ``args`` (argparse.Namespace) and the
    numpy RNG state (arrays rebuilt by numpy's reconstruct helper). Allowed only for these files, only for
    that load; none of them runs user code."""
    import numpy.core.multiarray as multiarray

    return (argparse.Namespace, multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32")))


def _torch_load(path, extra_globals=()):
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
        raise LayerdiffError(f"{path}: not a readable PyTorch checkpoint ({_first_line(exc)})") from None


class _TorchFile(Checkpoint):
    format = "torch"

    def __init__(self, path, obj=None, mmapped=None):
        super().__init__(path)
        import torch
        if obj is None:
            obj, mmapped = _torch_load(path)
        self.whole = not mmapped
        skipped = []
        self._tensors = {}
        _flatten(obj, "", self._tensors, lambda x: isinstance(x, torch.Tensor), skipped, source=path)
        if not self._tensors:
            raise LayerdiffError(f"{path}: no tensors in this PyTorch file")
        from .adapters.torch_adapter import dtype_name
        for name, t in self._tensors.items():
            dtype = dtype_name(t)
            if dtype is None:
                raise LayerdiffError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
            self._index[name] = (dtype, list(t.shape))

    def _load(self, name):
        return _torch_stored(self._tensors[name])

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


def _load_pdparams(path) -> _InMemory:
    path = Path(path)
    if not path.is_file():
        raise LayerdiffError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            obj = _RestrictedUnpickler(f, encoding="latin1").load()
    except pickle.UnpicklingError as exc:
        raise LayerdiffError(f"{path}: refused: not a plain dict of arrays ({_first_line(exc)}); "
                             "layerdiff never unpickles arbitrary objects") from None
    except Exception as exc:
        raise LayerdiffError(f"{path}: not a readable .pdparams file ({_first_line(exc)})") from None
    if not isinstance(obj, dict):
        raise LayerdiffError(f"{path}: a .pdparams file should hold a dict of arrays, not {type(obj).__name__}")
    tensors, skipped = {}, []
    _flatten({k: v for k, v in obj.items() if k != "StructuredToParameterName@@"}, "", tensors,
             lambda x: isinstance(x, np.ndarray), skipped, source=path)
    out = {}
    for name, arr in tensors.items():
        if arr.dtype == object:
            raise LayerdiffError(f"{path}: {name!r} is an object array")
        out[name] = (arr, str(arr.dtype))
    if not out:
        raise LayerdiffError(f"{path}: no arrays in this .pdparams file")
    return _InMemory(path, "paddle", out)


# --------------------------------------------------------------------------------------------- mindspore
def _load_ms_ckpt(path) -> _InMemory:
    path = Path(path)
    if not path.is_file():
        raise LayerdiffError(f"{path}: no such file")
    try:
        import mindspore as ms
        params = ms.load_checkpoint(str(path))
    except Exception as exc:
        raise LayerdiffError(f"{path}: not a readable MindSpore checkpoint ({_first_line(exc)})") from None
    from .adapters.mindspore_adapter import to_stored
    out = {}
    for name, p in params.items():
        stored = to_stored(p)
        if stored is None:
            raise LayerdiffError(f"{path}: parameter {name!r} has an unsupported dtype")
        out[name] = (np.array(stored[0], copy=True), stored[1])
    return _InMemory(path, "mindspore", out)


# ------------------------------------------------------------------------------------------------- trace
class _TraceParams(Checkpoint):
    format = "layerdiff trace"

    def __init__(self, path, step="first"):
        super().__init__(path)
        from .core.traceformat import open_trace
        self._reader = open_trace(path)
        records = [r for r in self._reader.records if r["kind"] == "param" and r["tensors"]]
        if not records:
            crashed = self._reader.crashed
            self._reader.close()
            raise LayerdiffError(f"{path}: this trace holds no parameter values" + (
                " (its index ends early: a damaged record, or the writing process died)" if crashed else ""))
        steps = sorted({r.get("step", r["call"]) for r in records})
        chosen = steps[0] if step == "first" else steps[-1]
        self._entries = {}
        for r in records:
            if r.get("step", r["call"]) == chosen:
                t = r["tensors"][0]
                self._entries[r["path"]] = t
                self._index[r["path"]] = (t["dtype"], list(t["shape"]))

    def _load(self, name):
        t = self._entries[name]
        return self._reader.tensor(t), t["dtype"]

    def close(self):
        self._reader.close()


# ---------------------------------------------------------------------------------------------- megatron
_REPLICATED_HINT = re.compile(r"norm", re.I)
_COLUMN = re.compile(r"(^|\.)(query_key_value|linear_qkv|qkv|dense_h_to_4h|linear_fc1|fc1|word_embeddings|"
                     r"output_layer|q_proj|k_proj|v_proj|gate_proj|up_proj|lm_head)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)(dense|linear_proj|proj|dense_4h_to_h|linear_fc2|fc2|o_proj|down_proj)\.weight$")
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")


def megatron_partition_dim(name: str):
    """0 for column-parallel, 1 for row-parallel weights, None for replicated (taken from TP rank 0)."""
    leaf = name.rpartition(".")[2]
    if _REPLICATED_HINT.search(leaf):
        return None
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def _megatron_iter_dir(path: Path) -> Path:
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        try:
            with open(tracker, "rb") as f:
                text = f.read(100).decode("utf-8", errors="replace").strip()
        except OSError as exc:
            raise LayerdiffError(f"{tracker}: cannot read ({exc.strerror or exc})") from None
        if text == "release":
            sub = path / "release"
        elif re.fullmatch(r"[0-9]{1,12}", text):
            sub = path / f"iter_{int(text):07d}"
        else:
            raise LayerdiffError(f"{tracker}: expected an iteration number, found {text[:40]!r}")
        if not sub.is_dir():
            raise LayerdiffError(f"{tracker} names {sub.name}, which does not exist")
        return sub
    return path


def _is_megatron(path: Path) -> bool:
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return True
    return any(_RANK_DIR.match(p.name) and p.is_dir() for p in path.iterdir())


def megatron_args(path) -> dict:
    """The training arguments a Megatron-LM checkpoint stores (``args``, an argparse.Namespace), as a dict with
    Megatron's underscore names; from a checkpoint directory (its latest iteration, first rank) or one
    ``model_optim_rng.pt``. Loaded with ``weights_only`` and only Megatron's own extra types admitted."""
    path = Path(path)
    if path.is_dir():
        it = _megatron_iter_dir(path)
        files = sorted(f for d in sorted(it.iterdir()) if _RANK_DIR.match(d.name) and d.is_dir()
                       for f in d.glob("*.pt"))
        if not files:
            raise LayerdiffError(f"{path}: no mp_rank_XX/*.pt file (not a Megatron checkpoint)")
        path = files[0]
    state, _ = _torch_load(path, _megatron_globals())
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise LayerdiffError(f"{path}: holds no Megatron args (a checkpoint saved without them?)")
    return {k: v for k, v in vars(args).items() if isinstance(k, str)}


def _load_megatron(path: Path) -> _InMemory:
    import torch
    it = _megatron_iter_dir(path)
    ranks = {}
    for d in sorted(it.iterdir()):
        m = _RANK_DIR.match(d.name)
        if m and d.is_dir():
            ranks[(int(m.group(2) or 0), int(m.group(1)))] = d  # (pp, tp)
    if not ranks:
        raise LayerdiffError(f"{it}: no mp_rank_XX folders (not a Megatron checkpoint iteration)")
    pps = sorted({pp for pp, _ in ranks})
    tps = sorted({tp for _, tp in ranks})
    for pp in pps:
        have = sorted(tp for p, tp in ranks if p == pp)
        if have != list(range(len(have))) or len(have) != len(tps):
            raise LayerdiffError(f"{it}: tensor-parallel ranks of pipeline rank {pp} are incomplete: {have}")
    if pps != list(range(len(pps))):
        raise LayerdiffError(f"{it}: pipeline ranks are incomplete: {pps}")
    merged, layer_offset = {}, 0
    for pp in pps:
        states = []
        for tp in tps:
            d = ranks[(pp, tp)]
            files = sorted(d.glob("*.pt"))
            if not files:
                raise LayerdiffError(f"{d}: no .pt file")
            file = d / "model_optim_rng.pt" if (d / "model_optim_rng.pt").is_file() else files[0]
            obj, _ = _torch_load(file, extra_globals=_megatron_globals())
            if not isinstance(obj, dict):
                raise LayerdiffError(f"{file}: not a Megatron checkpoint (not a dict)")
            models = sorted(k for k in obj if re.fullmatch(r"model\d*", str(k)))
            if not models:
                raise LayerdiffError(f"{file}: no 'model' entry (not a Megatron checkpoint)")
            flat = {}
            for key in models:
                part = {}
                _flatten(obj[key], "", part, lambda x: isinstance(x, torch.Tensor), [], source=file)
                prefix = f"{key}." if len(models) > 1 else ""
                flat.update({prefix + k: v for k, v in part.items()})
            states.append((file, flat))
            del obj
        names0 = list(states[0][1])
        for file, flat in states[1:]:
            if set(flat) != set(names0):
                diff_names = sorted(set(flat) ^ set(names0))[:3]
                raise LayerdiffError(f"{file}: parameter names differ from TP rank 0 (e.g. {diff_names})")
        local_layers = 0
        for name in names0:
            dim = megatron_partition_dim(name)
            parts = [flat[name] for _, flat in states]
            if dim is not None and parts[0].dim() > dim:
                try:
                    value = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
                except RuntimeError:
                    raise LayerdiffError(f"{it}: the TP shards of {name!r} cannot be joined on dim {dim} (shapes "
                                         f"{[list(p.shape) for p in parts][:4]})") from None
            else:
                if any(p.shape != parts[0].shape for p in parts[1:]):
                    raise LayerdiffError(f"{it}: {name!r} has different shapes on TP ranks but no partition "
                                         "rule (see megatron_partition_dim)")
                value = parts[0]
            m = _LAYER.search(name)
            if m and len(m.group(2)) > 9:
                raise LayerdiffError(f"{it}: layer number of {name[:120]!r} is implausibly large")
            if m:
                local_layers = max(local_layers, int(m.group(2)) + 1)
                name = name[:m.start(2)] + str(int(m.group(2)) + layer_offset) + name[m.end(2):]
            if name in merged:
                continue  # e.g. tied embeddings on first and last stage: keep the first
            stored = _torch_stored(value)
            merged[name] = (np.array(stored[0], copy=True), stored[1])
        layer_offset += local_layers
        del states
    ck = _InMemory(it, "megatron", merged)
    ck.notes.append(f"merged TP={len(tps)} x PP={len(pps)} from {it.name}")
    return ck


# ---------------------------------------------------------------------------------------------- dispatch
def _sniff(path: Path) -> str | None:
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "h5"
    if head.startswith(b"PK\x03\x04"):
        import zipfile
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except Exception:
            return None
        if any(n.endswith("data.pkl") for n in names):
            return "torch"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return None
    if head[:1] == b"\x80":
        return "pickle"
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    return None


def open_checkpoint(path, *, trace_step: str = "first") -> Checkpoint:
    """A checkpoint file or folder in any supported format (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise LayerdiffError(f"{path}: no such file or folder")
    try:
        if path.is_dir():
            return _open_dir(path)
        return _open_file(path, trace_step)
    except PermissionError as exc:
        raise LayerdiffError(f"{path}: permission denied ({exc.filename})") from None
    except IsADirectoryError as exc:
        raise LayerdiffError(f"{path}: unexpected folder {exc.filename}") from None


def _open_dir(path: Path) -> Checkpoint:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_index(index)
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise LayerdiffError(f"{index}: shard {f.relative_to(path)} is missing")
        ck = _Safetensors(path, files)
        missing = set(weight_map) - set(ck.names())
        if missing:
            raise LayerdiffError(f"{index}: {len(missing)} tensors listed but not in the shards "
                                 f"(e.g. {sorted(missing)[0]})")
        ck.format = "safetensors (sharded)"
        return ck
    if (path / "model.safetensors").is_file():
        return _Safetensors(path, [path / "model.safetensors"])
    for name in ("pytorch_model.bin", "model.pt"):
        if (path / name).is_file():
            return _TorchFile(path / name)
    if _is_megatron(path):
        return _load_megatron(path)
    single = sorted(path.glob("*.safetensors"))
    if single:
        return _Safetensors(path, single)
    raise LayerdiffError(f"{path}: folder holds no known checkpoint (model.safetensors, an index, "
                         "pytorch_model.bin, or a Megatron layout)")


_MAX_INDEX_BYTES = 100 << 20  # a real index lists a few thousand names: a few hundred KB


def _read_index(index: Path) -> dict:
    """``weight_map`` of a Hugging Face ``model.safetensors.index.json``: tensor name -> shard file, each shard a
    relative path inside the folder (no absolute path, no ``..``); anything else is one error naming the file."""
    def bad(what):
        return LayerdiffError(f"{index}: not a valid safetensors index ({what})")

    try:
        if index.stat().st_size > _MAX_INDEX_BYTES:
            raise bad(f"larger than {_MAX_INDEX_BYTES >> 20} MB")
        data = json.loads(index.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("not UTF-8 text") from None
    except RecursionError:
        raise bad("JSON nested too deeply") from None
    except ValueError as exc:  # not JSON, or an integer of more than 4300 digits
        raise bad(f"not JSON: {_first_line(exc)[:100]}") from None
    except OSError as exc:
        raise LayerdiffError(f"{index}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(data, dict) or "weight_map" not in data:
        raise bad("no weight_map object")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        raise bad("weight_map must be a non-empty object mapping tensor names to shard files")
    for name, shard in weight_map.items():
        shown = name if len(name) <= 80 else name[:77] + "..."
        if not isinstance(shard, str) or not shard or "\0" in shard:
            raise bad(f"the shard of {shown!r} is not a file name")
        if "\\" in shard or PurePosixPath(shard).is_absolute() or ".." in PurePosixPath(shard).parts:
            raise bad(f"shard {shard[:80]!r} of {shown!r} is not a relative path inside the folder")
    return weight_map


def _open_file(path: Path, trace_step: str) -> Checkpoint:
    suffix = path.suffix.lower()
    if path.stat().st_size == 0:
        raise LayerdiffError(f"{path}: empty file")
    kind = _sniff(path)
    if suffix == ".safetensors" or (kind == "safetensors" and suffix not in (".pt", ".bin", ".pth")):
        return _Safetensors(path, [path])
    if suffix == ".npz" or kind == "npz":
        return _Npz(path)
    if suffix in (".h5", ".hdf5", ".trace") or kind == "h5":
        return _TraceParams(path, trace_step)
    if suffix == ".pdparams":
        return _load_pdparams(path)
    if suffix == ".ckpt":
        return _load_ms_ckpt(path)
    if suffix in (".pt", ".pth", ".bin") or kind in ("torch", "pickle"):
        return _TorchFile(path)
    raise LayerdiffError(f"{path}: unknown checkpoint format (expected .safetensors, .pt/.bin, .pdparams, "
                         ".ckpt, .npz, a trace .h5, or a model folder)")


# ------------------------------------------------------------------------------------------------ digest
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


# -------------------------------------------------------------------------------------------------- diff
def _spill(ck: Checkpoint) -> Checkpoint:
    """Write a whole-loaded checkpoint to a temporary safetensors file and free it (one side in memory)."""
    tensors = {}
    for name in ck.names():
        arr, dtype = ck.load(name)
        if dtype not in safetensors_io._TO_ST:
            return ck  # cannot spill (complex): keep in memory
        tensors[name] = (arr, dtype)
    target = Path(tempfile.mkdtemp(prefix="layerdiff-ckpt-")) / "a.safetensors"
    safetensors_io.save(target, tensors)
    del tensors
    spilled = _Safetensors(ck.path, [target])
    spilled.format, spilled.notes, spilled._tmp = ck.format, ck.notes, target
    ck.close()
    return spilled


def _l2(a_raw, b_raw, dtype_a, dtype_b) -> float:
    from .core.tensors import as_float
    a, b = as_float(a_raw, dtype_a).reshape(-1), as_float(b_raw, dtype_b).reshape(-1)
    total = 0.0
    for i in range(0, a.size, 1 << 20):
        d = a[i:i + (1 << 20)].astype(np.float64) - b[i:i + (1 << 20)].astype(np.float64)
        total += float(np.dot(d, d))
    return math.sqrt(total)


def diff(a: Checkpoint, b: Checkpoint, *, mapping: RenameRules | None = None, exact: bool = False,
         transpose=None, rules: RuleSet | None = None) -> dict:
    """Compare every parameter of ``b`` (renamed into ``a``'s names) with ``a``.

    Names match after ``canonical_param_name`` (gamma/beta/embedding_table aliases) and ``mapping`` (B -> A).
    ``transpose``: regexes (on A's names) whose B tensor is compared transposed; without one, a 2-D B tensor
    whose shape is A's transposed (and not square) is compared transposed and marked ``"transposed": true``.
    A parameter is "identical" when max_diff == 0 and no NaN/Inf differs, "different" otherwise; without
    ``exact``, a different parameter also gets ``within_tolerance`` (layerdiff's default per-dtype
    tolerances, e.g. fp32 atol 1e-8 + rtol 2e-5, cos 0.99999), for information only. ``exact`` drops that
    and also counts a dtype change with equal values as a difference.
    Returns ``{name: {"l2", "cos", "max_diff", "mean_diff", "numel", "shape", "dtype", ...}, "__summary__":
    {...}}`` in A's names.
    """
    from .core.metrics import compare_arrays
    rename = mapping or RenameRules()
    patterns = _transpose_patterns(transpose)
    a_names = {canonical_param_name(n): n for n in a.names()}
    b_to_a = {}
    for n in b.names():
        key = canonical_param_name(rename(n))
        if key in b_to_a:
            raise LayerdiffError(f"{b.path}: {n!r} and {b_to_a[key]!r} both map to {key!r}")
        b_to_a[key] = n
    if a.whole and b.whole:
        a = _spill(a)
    plans, groups, missing, extra = _plan_names(a, b, a_names, b_to_a, rename, rules or ruleset())
    from .core.tolerance import DEFAULTS, dtype_class, judge
    result, identical, different, max_all, shape_mismatch, near = {}, 0, 0, 0.0, [], 0
    for source in plans:
        na = source.name
        dta, sha = a.info(na)
        entry = {"numel": int(np.prod(sha, dtype=np.int64)), "shape": list(sha), "dtype": dta}
        xa, _ = a.load(na)
        if source.op == "same":
            nb = source.sources[0]
            dtb, shb = b.info(nb)
            xb, _ = b.load(nb)
        else:  # one part of B's fused parameter, or B's parts merged
            nb = source.describe()
            dtb = b.info(source.sources[0])[0]
            xb = paramplan.build(source, lambda n: b.load(n)[0], groups[na])
            shb = list(xb.shape)
        if nb != na:
            entry["b_name"] = nb
        if dtb != dta:
            entry["dtype_b"] = dtb
        forced = any(p.search(na) for p in patterns)
        if forced or (list(shb) != list(sha) and len(sha) == 2 and list(shb) == list(sha)[::-1]):
            if len(shb) != 2:
                raise LayerdiffError(f"{na}: transpose rule matches a {len(shb)}-D tensor")
            xb = xb.T
            entry["transposed"] = True
        if list(xb.shape) != list(sha):
            entry.update({"status": "shape_mismatch", "shape_b": list(shb)})
            shape_mismatch.append(na)
            different += 1
            result[na] = entry
            continue
        if dta in ("complex64", "complex128") or dtb in ("complex64", "complex128"):
            raise LayerdiffError(f"{na}: complex tensors are not compared")
        m = compare_arrays(np.ascontiguousarray(xa), np.ascontiguousarray(xb), dta, dtb)
        entry.update({"l2": _l2(xa, xb, dta, dtb), "cos": m["cosine"], "max_diff": m["max_abs"],
                      "mean_diff": m.get("mean_abs", 0.0)})
        if m["nonfinite_mismatch"]:
            entry["nonfinite_mismatch"] = m["nonfinite_mismatch"]
        same = m["identical"] and not (exact and dtb != dta)
        entry["status"] = "identical" if same else "different"
        if not same and not exact:  # informative only: the verdict stays "different"
            entry["within_tolerance"] = judge(m, DEFAULTS[dtype_class(dta, dtb)])[0]
            near += entry["within_tolerance"]
        identical += same
        different += not same
        if math.isfinite(m["max_abs"]):
            max_all = max(max_all, m["max_abs"])
        result[na] = entry
        del xa, xb
    result["__summary__"] = {
        "a": str(a.path), "b": str(b.path), "format_a": a.format, "format_b": b.format,
        "compared": len(plans), "identical": identical, "different": different,
        "different_within_tolerance": near,
        "shape_mismatch": shape_mismatch, "missing_in_b": missing, "extra_in_b": extra,
        "max_abs_diff": max_all, "exact": exact, "notes": a.notes + b.notes,
    }
    return result


def _transpose_patterns(transpose) -> list:
    """``--transpose`` regexes, compiled; a bad one is one error naming it."""
    patterns = []
    for p in transpose or ():
        try:
            patterns.append(re.compile(p))
        except (re.error, OverflowError, RecursionError, ValueError) as exc:
            shown = p if len(p) <= 80 else p[:77] + "..."
            raise LayerdiffError(f"bad --transpose {shown!r}: {_first_line(exc)[:100]}") from None
    return patterns


def _plan_names(a: Checkpoint, b: Checkpoint, a_names: dict, b_to_a: dict, rename, rules):
    """Where each of A's parameters is in B: by name (after ``--map`` and aliases) when the names agree, else
    through the matched modules (renamed, fused: HF q_proj is rows of Megatron's linear_qkv). Returns (sources
    in A's order, {A name: group count}, A names missing in B, B names left over)."""
    common = [k for k in a_names if k in b_to_a]
    if len(common) == len(a_names) or len(common) == len(b_to_a):
        plans = [ParamSource(a_names[k], "same", (b_to_a[k],)) for k in common]
        return (plans, {}, sorted(a_names[k] for k in a_names if k not in b_to_a),
                sorted(b_to_a[k] for k in b_to_a if k not in a_names))

    def infos(ck):
        return modules.from_params([(n, ck.info(n)[1], _stats(ck, n)) for n in ck.names()])

    mapping = match_modules(infos(a), infos(b), rules, rename)
    plans, missing, used = paramplan.plan(mapping, {n: tuple(a.info(n)[1]) for n in a.names()},
                                          {n: tuple(b.info(n)[1]) for n in b.names()}, "a")
    groups = {p.name: paramplan.group_count(p, rules, [], load=lambda n: b.load(n)[0],
                                            own_load=lambda n: a.load(n)[0]) for p in plans if p.op != "same"}
    return plans, groups, sorted(missing), sorted(n for n in b.names() if n not in used)


def _stats(ck: Checkpoint, name: str) -> dict:
    values, dtype = ck.load(name)
    return summarize(values, dtype)


def _cleanup(ck):
    ck.close()
    tmp = getattr(ck, "_tmp", None)
    if tmp is not None:
        tmp.unlink(missing_ok=True)
        try:
            tmp.parent.rmdir()
        except OSError:
            pass


# --------------------------------------------------------------------------------------------------- CLI
def _parse_digests(specs, paths):
    """--sha256 values: None (flag absent), [] / [""] (print only), or PATH=HEX / HEX entries."""
    expected = {}
    for spec in specs or ():
        if not spec:
            continue
        p, eq, hexd = spec.rpartition("=")
        if not eq:
            raise LayerdiffError(f"bad --sha256 {spec!r}: expected PATH=HEX")
        hexd = hexd.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", hexd):
            raise LayerdiffError(f"bad --sha256 {spec!r}: not a 64-digit hex SHA-256")
        target = Path(p).resolve()
        if target not in paths:
            raise LayerdiffError(f"--sha256 {p}: not one of the compared checkpoints")
        expected[target] = hexd
    return expected


def compare_files(path_a, path_b, *, mapping=None, exact: bool = False, transpose=None, rules=None) -> dict:
    """The per-parameter report of ``layerdiff weights diff A B`` (what ``-o`` writes)."""
    rename = RenameRules.parse(mapping)
    _transpose_patterns(transpose)  # a bad regex is refused before any file is read
    a = open_checkpoint(path_a)
    try:
        if a.whole:  # held in memory: move it to a temporary safetensors file before B is loaded
            a = _spill(a)
        b = open_checkpoint(path_b)
        try:
            return diff(a, b, mapping=rename, exact=exact, transpose=transpose, rules=ruleset(rules))
        finally:
            _cleanup(b)
    finally:
        _cleanup(a)


def run(args) -> int:
    """``layerdiff weights diff A B``: 0 when every compared parameter is identical and none is missing, 1 else."""
    from .core.report import make_console, write_json
    quiet = getattr(args, "quiet", False)
    console = make_console(stderr=False, quiet=quiet)
    output = getattr(args, "output", None)
    if output and Path(output).exists() and not getattr(args, "force", False):
        raise LayerdiffError(f"{output} exists; pass --force to replace it")
    specs = getattr(args, "sha256", None)
    if specs is not None:
        paths = {Path(args.a).resolve(): args.a, Path(args.b).resolve(): args.b}
        expected = _parse_digests(specs, paths)
        for target, shown in paths.items():
            digest = file_digest(target)
            console.print(f"sha256 {digest}  {shown}")
            if target in expected and expected[target] != digest:
                raise LayerdiffError(f"{shown}: SHA-256 mismatch (expected {expected[target]}, got {digest})")
    exact = bool(getattr(args, "exact", False))
    report = compare_files(args.a, args.b, mapping=getattr(args, "map", None), exact=exact,
                           transpose=getattr(args, "transpose", None), rules=getattr(args, "rules", None))
    summary = report["__summary__"]
    if output:
        write_json(report, output, overwrite=getattr(args, "force", False))
    if not quiet:
        _render(report, console, exact)
        if output:
            console.print(f"report written to {output}")
    bad = summary["different"] or summary["missing_in_b"] or summary["extra_in_b"]
    return 1 if bad else 0


def _render(report: dict, console, exact: bool, shown: int = 20):
    from rich.table import Table
    s = report["__summary__"]
    console.print(f"[bold]A[/] {s['a']} ({s['format_a']})   [bold]B[/] {s['b']} ({s['format_b']})")
    for note in s["notes"]:
        console.print(f"[dim]{note}[/]")
    rows = [(k, v) for k, v in report.items() if k != "__summary__" and v.get("status") != "identical"]
    rows.sort(key=lambda kv: (kv[1]["status"] != "shape_mismatch", -(kv[1].get("max_diff") or 0.0)))
    limit = len(rows) if exact else shown
    if rows:
        table = Table(title="parameters that differ (largest first)")
        for col in ("parameter", "shape", "dtype", "max_diff", "l2", "cos", "note"):
            table.add_column(col, justify="left" if col in ("parameter", "shape", "dtype", "note") else "right")
        for name, e in rows[:limit]:
            if e["status"] == "shape_mismatch":
                table.add_row(name, f"{e['shape']} vs {e['shape_b']}", e["dtype"], "", "", "", "[red]shape differs[/]")
                continue
            dtype = e["dtype"] + (f"/{e['dtype_b']}" if "dtype_b" in e else "")
            notes = ([f"B: {e['b_name']}"] if e.get("b_name") else []) + \
                (["B transposed"] if e.get("transposed") else []) + \
                (["within default tolerance"] if e.get("within_tolerance") else [])
            cos = e["cos"]
            cos_text = f"1-{1 - cos:.2g}" if 0.999999 < cos < 1 else f"{cos:.6f}"
            table.add_row(name, str(e["shape"]), dtype, f"{e['max_diff']:.3g}", f"{e['l2']:.3g}", cos_text,
                          ", ".join(notes))
        console.print(table)
        if len(rows) > limit:
            console.print(f"... and {len(rows) - limit} more (see -o JSON, or --exact for all)")
    for label, key in (("missing in B", "missing_in_b"), ("extra in B", "extra_in_b")):
        if s[key]:
            console.print(f"[yellow]{len(s[key])} {label}:[/] " + ", ".join(s[key][:8])
                          + (" ..." if len(s[key]) > 8 else ""))
    verdict = "[green]identical[/]" if not (s["different"] or s["missing_in_b"] or s["extra_in_b"]) \
        else "[red]different[/]"
    console.print(f"{s['compared']} compared: {s['identical']} identical, {s['different']} different"
                  + (f" ({s['different_within_tolerance']} within default tolerance)"
                     if s.get("different_within_tolerance") else "")
                  + f"; {len(s['missing_in_b'])} missing in B, {len(s['extra_in_b'])} extra in B; "
                  f"max abs diff {s['max_abs_diff']:.3g} -> {verdict}")


def register(sub, parser_class=None):
    """Add ``diff`` under the ``layerdiff weights`` subparsers ``sub``; sets ``func=run``."""
    p = sub.add_parser("diff", help="compare two checkpoints parameter by parameter (l2, cos, max diff)",
                       description="Compare two checkpoints (safetensors, HF folder, .pt/.bin, .pdparams, .ckpt, "
                                   ".npz, trace .h5, Megatron folder). Exit 0 identical, 1 different, 2 error.")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("-o", "--output", metavar="FILE.json", help="write the per-parameter report as JSON")
    p.add_argument("--exact", action="store_true", help="list every parameter with any difference")
    p.add_argument("--map", action="append", default=[], metavar="PATTERN=REPLACEMENT",
                   help="rename B's parameter names to A's (regex; repeatable, or a file of rules)")
    p.add_argument("--transpose", action="append", default=[], metavar="REGEX",
                   help="compare B's tensor transposed for A names matching REGEX (e.g. Paddle Linear weights)")
    p.add_argument("--sha256", nargs="?", action="append", const="", metavar="PATH=HEX",
                   help="print both SHA-256 digests; with PATH=HEX, verify that file (repeatable)")
    p.add_argument("--rules", action="append", metavar="FILE.toml",
                   help="extra naming/fusion rules (see README, 'Rule files'); repeatable")
    p.add_argument("--force", action="store_true", help="overwrite the -o file")
    p.add_argument("-q", "--quiet", action="store_true", help="no table; exit status only")
    p.set_defaults(func=run)
    return p
