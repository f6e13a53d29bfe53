"""PyTorch Distributed Checkpoint folders (``.metadata`` + ``*.distcp``): Megatron-core's ``torch_dist`` format,
and what FSDP or torchtitan save with ``torch.distributed.checkpoint``.

The ``.metadata`` pickle lists every tensor's global shape, dtype and chunks (a chunk is one rank's shard, at its
offsets); each chunk sits in a ``.distcp`` file as a ``torch.save`` blob. The pickle is read with only PyTorch's
checkpoint-metadata classes admitted, and each chunk with ``torch.load(weights_only=True)``: nothing else is
ever unpickled. A tensor is assembled from its chunks when it is asked for, so tensor-parallel shards come out
joined and memory holds one tensor at a time.

Megatron-core stacks its transformer layers: ``decoder.layers.self_attention.linear_qkv.weight`` holds every
layer's weight along a leading axis (pipeline stages included), and an MoE layer's experts along the next one
(``decoder.layers.mlp.experts.experts.linear_fc1.weight``). Such a name is read as one tensor per layer and
expert, under the model's own names (``decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight``).
Optimizer state (``optimizer.``) and non-tensor entries (``_extra_state``) are left out and counted in the notes.
"""
from __future__ import annotations

import io
import itertools
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from layerdiff.checkpoints.formats import Checkpoint, first_line, torch_stored
from layerdiff.errors import LayerdiffError

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                     "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint._extension")
_PLAIN_GLOBALS = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
                  ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}
# Megatron-core's stacked axes, leading in this order: a ``layers`` segment not followed by a number holds every
# layer; ``experts.experts`` every local expert of an MoE layer (``experts.local_experts.N`` in the model)
_STACKED = ((re.compile(r"(?:^|(?<=\.))layers\.(?!\d+(?:\.|$))"), "layers.{}."),
            (re.compile(r"(?<=\.)experts\.experts\."), "experts.local_experts.{}."))
_SKIPPED_PREFIXES = ("optimizer.", "rng_state")
_MAX_LAYERS = 1 << 20


def is_dist_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file() and any(path.glob("*.distcp"))


def _stacked_axes(key: str, shape: list) -> list:
    """The stacked segments of ``key`` in order, one per leading axis of ``shape`` (none if they do not fit)."""
    found = sorted(((m.start(), m.end(), template) for pattern, template in _STACKED
                    for m in [pattern.search(key)] if m is not None))
    if not found or len(shape) < len(found) or any(n > _MAX_LAYERS for n in shape[:len(found)]):
        return []
    return found


def _unstacked_name(key: str, axes: list, index: tuple) -> str:
    """``decoder.layers.mlp.experts.experts.linear_fc1.weight`` at (3, 7):
    ``decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight``."""
    pieces, at = [], 0
    for (start, end, template), i in zip(axes, index):
        pieces += [key[at:start], template.format(i)]
        at = end
    return "".join(pieces) + key[at:]


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """The classes a ``.metadata`` pickle is made of (plain dataclasses and enums), torch.Size, dtypes, layouts."""

    def find_class(self, module, name):
        import torch

        if module in _METADATA_MODULES and not name.startswith("__"):
            value = super().find_class(module, name)
            if isinstance(value, type):
                return value
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) in _PLAIN_GLOBALS:
            return super().find_class(module, name)
        raise _Refused(f"global {module}.{name} is not allowed")


def _read_metadata(path: Path):
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise LayerdiffError(f"{path}: refused: not PyTorch checkpoint metadata ({first_line(exc)}); "
                             "layerdiff never unpickles arbitrary objects") from None
    except OSError as exc:
        raise LayerdiffError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # truncated, or another pickle's bytes
        raise LayerdiffError(f"{path}: not readable checkpoint metadata ({first_line(exc)})") from None
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise LayerdiffError(f"{path}: not PyTorch checkpoint metadata ({type(metadata).__name__})")
    return metadata


class DistCheckpoint(Checkpoint):
    format = "torch_dist"

    def __init__(self, path):
        super().__init__(path)
        import torch

        from layerdiff.adapters import load_adapter

        dtype_name = load_adapter("torch").dtype_name

        metadata = _read_metadata(self.path / ".metadata")
        storage = {(index.fqn, tuple(index.offset or ())): info for index, info in metadata.storage_data.items()}
        self._parts: dict = {}  # name -> (key, index along the stacked axes or None, [(offsets, sizes, info)])
        head: list[tuple[str, tuple]]
        tail: list[tuple[str, tuple]]
        layers: dict[int, list[tuple[str, tuple]]]
        head, layers, tail = [], {}, []  # names in model order: what precedes the layers, layer by layer, the rest
        skipped, objects = 0, 0
        for key, meta in metadata.state_dict_metadata.items():
            if not hasattr(meta, "chunks"):
                objects += 1
                continue
            if key.startswith(_SKIPPED_PREFIXES):
                skipped += 1
                continue
            dtype = dtype_name(torch.empty(0, dtype=meta.properties.dtype))
            if dtype is None:
                raise LayerdiffError(f"{self.path}: tensor {key!r} has unsupported dtype {meta.properties.dtype}")
            shape = [int(s) for s in meta.size]
            chunks = []
            for chunk in meta.chunks:
                info = storage.get((key, tuple(chunk.offsets)))
                if info is None:
                    raise LayerdiffError(f"{self.path}: the metadata lists a chunk of {key!r} at "
                                         f"{list(chunk.offsets)} that no .distcp file holds")
                chunks.append((tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes), info))
            axes = _stacked_axes(key, shape)
            if axes:
                for index in itertools.product(*(range(n) for n in shape[:len(axes)])):
                    name = _unstacked_name(key, axes, index)
                    self._parts[name] = (key, index, chunks)
                    layers.setdefault(index[0], []).append((name, (dtype, shape[len(axes):])))
            else:
                self._parts[key] = (key, None, chunks)
                (tail if layers else head).append((key, (dtype, shape)))
        self._index = dict(head + [entry for layer in sorted(layers) for entry in layers[layer]] + tail)
        if not self._index:
            raise LayerdiffError(f"{self.path}: this distributed checkpoint holds no model tensors")
        self.notes.append(f"{len(metadata.state_dict_metadata)} entries read from {self.path.name}/.metadata" + (
            f"; left out: {skipped} optimizer / RNG tensors" if skipped else "") + (
            f", {objects} non-tensor entries" if objects else ""))
        self._last: tuple[Any, Any] = (None, None)  # the last chunk read: a chunk can hold several layers

    def _load(self, name):
        key, index, chunks = self._parts[name]
        dtype, shape = self._index[name]
        out, filled = None, 0
        for offsets, sizes, info in chunks:
            if index is not None and not all(o <= i < o + n for i, o, n in zip(index, offsets, sizes)):
                continue
            array = self._chunk(key, info)
            if array.size != int(np.prod(sizes)):
                raise LayerdiffError(f"{self.path}: a chunk of {key!r} holds {array.size} values, its metadata "
                                     f"says {list(sizes)}")
            array = array.reshape(sizes)
            if index is not None:
                k = len(index)
                array = array[tuple(i - o for i, o in zip(index, offsets))]
                offsets, sizes = offsets[k:], sizes[k:]
            if out is None:
                out = np.empty(shape, dtype=array.dtype)
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = array
            filled += array.size
        if out is None or filled != out.size:
            raise LayerdiffError(f"{self.path}: the chunks of {key!r} do not cover the tensor")
        return out, dtype

    def _chunk(self, key: str, info) -> np.ndarray:
        """One chunk as stored (numpy bits), from its ``torch.save`` blob in the .distcp file."""
        import torch

        where = (info.relative_path, info.offset)
        if self._last[0] == where:
            return self._last[1]
        if getattr(info, "transform_descriptors", None):
            raise LayerdiffError(f"{self.path}: {key!r} is stored transformed ({info.transform_descriptors}); "
                                 "only plain chunks are read")
        file = self.path / info.relative_path
        if Path(info.relative_path).is_absolute() or ".." in Path(info.relative_path).parts:
            raise LayerdiffError(f"{self.path}/.metadata: chunk file {info.relative_path!r} is outside the folder")
        try:
            with open(file, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
        except OSError as exc:
            raise LayerdiffError(f"{file}: cannot read ({exc.strerror or exc})") from None
        if len(blob) != info.length:
            raise LayerdiffError(f"{file}: truncated (the chunk of {key!r} ends past the end of the file)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise LayerdiffError(f"{file}: the chunk of {key!r} is not a plain tensor ({first_line(exc)})") from None
        if not isinstance(tensor, torch.Tensor):
            raise LayerdiffError(f"{file}: the chunk of {key!r} is not a tensor")
        array = torch_stored(tensor)[0]
        self._last = (where, array)
        return array
