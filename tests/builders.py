"""Synthetic trace records for framework-free tests of matching and judging: a few lines build what a traced
model would record, without a framework, a model or a file.

``entry`` makes one tensor, ``call`` one module call (forward or backward), ``param`` a parameter's value or
gradient; ``Trace`` holds records in memory with a reader's interface (``records``, ``meta``, ``tensor``), so
``measure``/``align`` run on it as on a file. Tensors get their values from ``Trace.put``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from layerdiff.tracefile.records import CallRecord, ParamGradRecord, ParamRecord, TensorEntry
from layerdiff.tracefile.tensors import storage_dtype, summarize


def entry(role: str, key: str, shape=(2, 4), dtype: str = "float32", *, values: np.ndarray | None = None,
          offset: int | None = None) -> TensorEntry:
    """A tensor entry; with ``values`` its statistics are theirs (and ``offset`` names them in a ``Trace``)."""
    shape = list(values.shape) if values is not None else list(shape)
    stats = summarize(np.asarray(values), dtype) if values is not None else {"numel": math.prod(shape)}
    nbytes = None if offset is None else math.prod(shape) * storage_dtype(dtype).itemsize
    return TensorEntry(role=role, key=key, dtype=dtype, shape=shape, stats=stats, offset=offset, nbytes=nbytes)


def call(path: str, tensors, *, phase: str = "forward", call_index: int = 0, step: int = 0, type: str | None = None,
         begin: int = 0, end: int = 0, parent: tuple | None = None, hparams: dict | None = None,
         arg_names=None) -> CallRecord:
    return CallRecord(phase=phase, path=path, call=call_index, step=step, type=type, begin=begin, end=end,
                      parent=parent, tensors=list(tensors), hparams=hparams, arg_names=arg_names)


def param(path: str, tensor: TensorEntry, *, grad: bool = False, module_type: str | None = None,
          call_index: int = 0, step: int = 0, seq: int = 0):
    kind = ParamGradRecord if grad else ParamRecord
    return kind(path=path, call=call_index, step=step, seq=seq, module=path.rpartition(".")[0],
                module_type=module_type, tensors=[tensor])


@dataclass
class Trace:
    """Records in memory, read like a trace file: ``put`` stores an array and returns its entry."""

    path: Path = Path("synthetic.h5")
    meta: dict = field(default_factory=lambda: {"framework": "torch", "model_class": "test.Model", "mode": "full"})
    records: list = field(default_factory=list)
    arrays: dict = field(default_factory=dict)
    end: object = None
    crashed: bool = False

    def put(self, role: str, key: str, values, dtype: str = "float32") -> TensorEntry:
        values = np.asarray(values, dtype=storage_dtype(dtype))
        offset = sum(a.nbytes for a in self.arrays.values())
        self.arrays[offset] = values
        return entry(role, key, dtype=dtype, values=values, offset=offset)

    def tensor(self, e: TensorEntry) -> np.ndarray:
        return self.arrays[e.offset].reshape(e.shape)

    def tensor_chunks(self, e: TensorEntry, chunk_elems: int):
        flat = self.tensor(e).reshape(-1)
        return (flat[i:i + chunk_elems] for i in range(0, flat.size, chunk_elems))

    def data_segments(self, e: TensorEntry):
        return None

    def size_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def close(self):
        pass
