"""``open_checkpoint``: which reader a file or folder needs, from its content first and its name second."""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from layerdiff.checkpoints.formats import (
    Checkpoint,
    NpzFile,
    SafetensorsFiles,
    TorchFile,
    TraceParams,
    first_line,
    load_ms_ckpt,
    load_pdparams,
)
from layerdiff.checkpoints.megatron import is_megatron, load_megatron
from layerdiff.checkpoints.torch_dcp import DistCheckpoint, is_dist_checkpoint
from layerdiff.errors import LayerdiffError


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


_TORCH_LAYOUT = ("safetensors", "safetensors (sharded)", "torch", "torch_dist")


def torch_layout_state(path) -> dict:
    """Every tensor of a checkpoint that holds PyTorch names and layouts, {name: (array, dtype)}, to load into a
    model. Other layouts are refused, and so are Megatron-LM's per-rank files: their SwiGLU fc1 merged from
    several ranks interleaves gate and up rows."""
    ck = open_checkpoint(path)
    try:
        if ck.format not in _TORCH_LAYOUT:
            raise LayerdiffError(f"{path}: weights are loaded from safetensors, PyTorch state dicts and distributed "
                                 f"checkpoints, not from a {ck.format} checkpoint; write one with `layerdiff weights "
                                 "export` from the model that reads it")
        return {name: ck.load(name) for name in ck.names()}
    finally:
        ck.close()


def _open_dir(path: Path) -> Checkpoint:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_index(index)
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise LayerdiffError(f"{index}: shard {f.relative_to(path)} is missing")
        ck = SafetensorsFiles(path, files)
        missing = set(weight_map) - set(ck.names())
        if missing:
            raise LayerdiffError(f"{index}: {len(missing)} tensors listed but not in the shards "
                                 f"(e.g. {sorted(missing)[0]})")
        ck.format = "safetensors (sharded)"
        return ck
    if (path / "model.safetensors").is_file():
        return SafetensorsFiles(path, [path / "model.safetensors"])
    for name in ("pytorch_model.bin", "model.pt"):
        if (path / name).is_file():
            return TorchFile(path / name)
    if is_dist_checkpoint(path):
        return DistCheckpoint(path)
    if is_megatron(path):
        return load_megatron(path)
    single = sorted(path.glob("*.safetensors"))
    if single:
        return SafetensorsFiles(path, single)
    raise LayerdiffError(f"{path}: folder holds no known checkpoint (model.safetensors, an index, "
                         "pytorch_model.bin, a Megatron layout, or a distributed checkpoint's .metadata)")


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
        raise bad(f"not JSON: {first_line(exc)[:100]}") from None
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
        return SafetensorsFiles(path, [path])
    if suffix == ".npz" or kind == "npz":
        return NpzFile(path)
    if suffix in (".h5", ".hdf5", ".trace") or kind == "h5":
        return TraceParams(path, trace_step)
    if suffix == ".pdparams":
        return load_pdparams(path)
    if suffix == ".ckpt":
        return load_ms_ckpt(path)
    if suffix in (".pt", ".pth", ".bin") or kind in ("torch", "pickle"):
        return TorchFile(path)
    raise LayerdiffError(f"{path}: unknown checkpoint format (expected .safetensors, .pt/.bin, .pdparams, "
                         ".ckpt, .npz, a trace .h5, or a model folder)")


