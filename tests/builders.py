"""Synthetic trace records for framework-free tests of matching and judging: a few lines build what a traced
model would record, without a framework, a model or a file.

``entry`` makes one tensor, ``call`` one module call (forward or backward), ``param`` a parameter's value or
gradient; ``Trace`` holds records in memory with a reader's interface (``records``, ``meta``, ``tensor``), so
``measure``/``align`` run on it as on a file. Tensors get their values from ``Trace.put``; ``Recorder`` writes
the records of a small model's run, calls nested as they ran.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
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
    ops: list = field(default_factory=list)
    arrays: dict = field(default_factory=dict)
    end: object = None
    crashed: bool = False
    damage: list = field(default_factory=list)  # the reader's damaged parts (``tracefile.index.Damage``)
    unverified: int = 0

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


class Recorder:
    """Writes what tracing a model would into a ``Trace``: module calls nested as they run, with their inputs,
    outputs and parameters. ``with rec.call("layers.0", "Block", x) as out: out.append(y)`` records one call of
    layers.0 taking x and returning y; calls opened inside it are its children."""

    def __init__(self, trace: Trace | None = None, phase: str = "forward"):
        self.trace = trace or Trace()
        self.phase = phase
        self.clock = 0
        self.open: list[tuple[str, int]] = []
        self.calls: dict[str, int] = {}

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    @contextmanager
    def call(self, path: str, type: str, *inputs, hparams: dict | None = None, roles=("input", "output")):
        begin, parent = self._tick(), (self.open[-1] if self.open else None)
        index = self.calls.get(path, 0)
        self.calls[path] = index + 1
        self.open.append((path, index))
        outputs: list = []
        try:
            yield outputs
        finally:
            self.open.pop()
        tensors = [self.trace.put(roles[0], f"args.{i}", x) for i, x in enumerate(inputs)]
        tensors += [self.trace.put(roles[1], "out" if len(outputs) == 1 else f"out.{i}", y)
                    for i, y in enumerate(outputs)]
        self.trace.records.append(call(path, tensors, phase=self.phase, call_index=index, type=type, begin=begin,
                                       end=self._tick(), parent=parent, hparams=hparams))

    def param(self, name: str, values, module_type: str | None = None) -> np.ndarray:
        """A parameter's value, recorded as tracing does before the first step; returns the values."""
        values = np.asarray(values, dtype=np.float32)
        self.trace.records.append(param(name, self.trace.put("param", "value", values), module_type=module_type))
        return values


def write_trace(trace: Trace, path, meta: dict | None = None) -> Path:
    """A ``Trace`` written as a real trace file (full mode), for what reads files: runs of ranks, worker processes
    and clusters that open traces by path."""
    import msgspec

    from layerdiff.tracefile.writer import TraceWriter

    writer = TraceWriter(path, {**trace.meta, **(meta or {})})
    for rec in trace.records:
        data = msgspec.to_builtins(rec)
        data["tensors"] = [{**writer.write_tensor(trace.arrays[t.offset], t.dtype, store_data=True),
                            "role": t.role, "key": t.key} for t in rec.tensors]
        writer.write_record(data)
    writer.close({"kind": "end", "status": "complete"})
    return Path(path)


def data_parallel_run(root, world: int, *, layers: int = 4, hidden: int = 64, batch: int = 16,
                      desync: tuple[int, int] | None = None) -> Path:
    """A data-parallel run of ``world`` ranks written as ``root/rank{N}.h5``: every rank runs the same blocks
    (a linear layer and a norm each, with their weights) on the same batch, except that ``desync`` = (rank, block)
    perturbs that block's weight on that rank (a replica that fell out of step)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((batch, hidden)).astype(np.float32)
    weights = [rng.standard_normal((hidden, hidden)).astype(np.float32) / np.sqrt(hidden) for _ in range(layers)]
    for rank in range(world):
        rec = Recorder()
        with rec.call("", "Model", x0) as model_out:
            x = x0
            for i in range(layers):
                w = weights[i] * (1.001 if desync == (rank, i) else 1.0)
                rec.param(f"layers.{i}.linear.weight", w, module_type="Linear")
                with rec.call(f"layers.{i}", "Block", x) as block_out:
                    with rec.call(f"layers.{i}.linear", "Linear", x) as out:
                        h = x @ w.T
                        out.append(h)
                    with rec.call(f"layers.{i}.norm", "RMSNorm", h) as out:
                        y = (h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + 1e-6)).astype(np.float32)
                        out.append(y)
                    x = x + y
                    block_out.append(x)
            model_out.append(x)
        write_trace(rec.trace, root / f"rank{rank}.h5",
                    {"model_class": "toy.Blocks", "distributed": {"rank": rank, "world_size": world}})
    return root
