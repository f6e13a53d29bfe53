"""What is known about each module of a run, as evidence for matching two runs: name, type, place in the tree,
execution order, block index, parameter shapes and value fingerprints, output sizes, hyper-parameters.

Three sources give the same ``ModuleInfo``: a trace's records (everything), a live model's module list (weight
transfer: no values, no order of execution), and a checkpoint's parameter names (checkpoint diff: values, no types).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from layerdiff.match.layouts import canonical_param_name
from layerdiff.tracefile.records import CallRecord

_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclass(frozen=True)
class Fingerprint:
    """Sums that survive transposes, reshapes, splits and concatenation: transferred weights keep them."""

    numel: int
    total: float
    squares: float
    low: float
    high: float

    @classmethod
    def of_stats(cls, stats: Mapping[str, Any] | None) -> Fingerprint | None:
        if not stats or stats.get("min") is None or stats.get("nan") or stats.get("inf"):
            return None
        n = stats["numel"]
        return cls(n, stats["mean"] * n, stats["l2"] ** 2, stats["min"], stats["max"])

    @property
    def informative(self) -> bool:
        """Random-looking values: a constant tensor (ones, zeros) says nothing about which module it is."""
        return self.high > self.low and self.squares > 0

    def combine(self, other: "Fingerprint") -> "Fingerprint":
        return Fingerprint(self.numel + other.numel, self.total + other.total, self.squares + other.squares,
                           min(self.low, other.low), max(self.high, other.high))

    def same(self, other: "Fingerprint", rtol: float = 2e-3) -> bool:
        if self.numel != other.numel:
            return False
        l2a, l2b = math.sqrt(self.squares), math.sqrt(other.squares)
        scale = max(abs(self.low), abs(self.high), 1e-30)
        return (abs(l2a - l2b) <= rtol * max(l2a, 1e-30) and abs(self.total - other.total) <= rtol * max(l2a, 1e-30)
                and abs(self.low - other.low) <= rtol * scale and abs(self.high - other.high) <= rtol * scale)


@dataclass(frozen=True)
class ParamInfo:
    leaf: str  # canonical leaf name: gamma is weight
    shape: tuple
    fingerprint: Fingerprint | None = None


@dataclass
class ModuleInfo:
    path: str
    type: str | None
    parent: str | None
    order: float  # first forward call (trace) or definition order
    params: list = field(default_factory=list)
    out_numels: tuple = ()
    hparams: dict = field(default_factory=dict)
    children: list = field(default_factory=list)  # paths
    called: bool = True
    in_prints: tuple = ()  # Fingerprints of its first call's float inputs (None where not computable)
    out_prints: tuple = ()  # ... and of its outputs: a tensor handed on keeps its fingerprint
    backward_children: list = field(default_factory=list)  # children seen in backward only (custom-backward cells)

    @property
    def local(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def indices(self) -> tuple:
        """The block indices in the path (``model.layers.3.mlp`` -> (3,)): modules are matched within a block."""
        return tuple(int(m) for m in _INDEX.findall(self.path))

    @property
    def param_shapes(self) -> tuple:
        return tuple(sorted((p.leaf, tuple(sorted(p.shape))) for p in self.params))


def _link_children(infos: dict):
    for info in infos.values():
        if info.parent is not None and info.parent in infos and info.parent != info.path:
            infos[info.parent].children.append(info.path)


def _nearest_known(path: str, known) -> str | None:
    while path:
        path = path.rpartition(".")[0]
        if path in known:
            return path
    return "" if "" in known and path != "" else None


def from_records(records) -> dict:
    """path -> ModuleInfo from a trace's records: the first step's forward calls, plus modules that own
    parameters but were never called (a tied or unused head)."""
    infos: dict[str, ModuleInfo] = {}
    calls = sorted((r for r in records if isinstance(r, CallRecord) and r.phase == "forward" and r.step == 0),
                   key=lambda r: r.begin)
    for r in calls:
        if r.path in infos:
            continue
        outs = tuple(math.prod(t.shape) for t in r.tensors if t.role == "output")
        infos[r.path] = ModuleInfo(r.path, r.type, r.parent[0] if r.parent else None, r.begin, out_numels=outs,
                                   hparams=dict(r.hparams or {}), in_prints=_prints(r, "input"),
                                   out_prints=_prints(r, "output"))
    seen = set()
    for r in records:
        if r.kind != "param" or r.path in seen or not r.tensors:
            continue
        seen.add(r.path)
        module = r.module_path
        if module not in infos:
            infos[module] = ModuleInfo(module, r.module_type, _nearest_known(module, infos), math.inf, called=False)
        t = r.tensors[0]
        leaf = canonical_param_name(r.path).rpartition(".")[2]
        infos[module].params.append(ParamInfo(leaf, tuple(t.shape), Fingerprint.of_stats(t.stats)))
    _link_children(infos)
    for r in records:  # a cell with a backward of its own runs unseen in forward (MindSpore): its parent knows it
        if isinstance(r, CallRecord) and r.phase == "backward" and r.step == 0 and r.path not in infos and r.parent:
            parent = infos.get(r.parent[0])
            if parent is not None and r.path not in parent.backward_children:
                parent.backward_children.append(r.path)
    return infos


def _prints(record: CallRecord, role: str) -> tuple:
    return tuple(Fingerprint.of_stats(t.stats) for t in record.tensors if t.role == role)


def from_model(entries) -> dict:
    """path -> ModuleInfo from a live model: ``entries`` are (path, type name, hparams, [(param leaf, shape)]) in
    the model's own module order (an adapter's ``module_entries``)."""
    infos: dict[str, ModuleInfo] = {}
    for order, (path, type_name, hparams, params) in enumerate(entries):
        info = ModuleInfo(path, type_name, None if path == "" else _nearest_known(path, infos), order,
                          hparams=dict(hparams or {}))
        info.params = [ParamInfo(canonical_param_name("x." + leaf).rpartition(".")[2], tuple(shape))
                       for leaf, shape in params]
        infos[path] = info
    _link_children(infos)
    return infos


def from_params(params) -> dict:
    """path -> ModuleInfo from parameter names alone (a checkpoint): ``params`` are (name, shape, stats or
    None) in the file's order; a module is a name's prefix, and every prefix up to the root exists."""
    infos: dict[str, ModuleInfo] = {"": ModuleInfo("", None, None, -1)}
    for order, (name, shape, stats) in enumerate(params):
        module, _, leaf = name.rpartition(".")
        parts = module.split(".") if module else []
        for i in range(1, len(parts) + 1):
            path = ".".join(parts[:i])
            if path not in infos:
                infos[path] = ModuleInfo(path, None, ".".join(parts[:i - 1]), order)
        infos[module].params.append(ParamInfo(canonical_param_name(name).rpartition(".")[2], tuple(shape),
                                              Fingerprint.of_stats(stats)))
    _link_children(infos)
    for info in infos.values():
        if info.local == "gate" and info.parent is not None and f"{info.parent}.experts" in infos:
            info.type = "Router"  # a checkpoint names no types: an MoE layer's "gate" beside its "experts"
    return infos


def find_blocks(paths, container: str | None = None) -> tuple[str, list[str]]:
    """The model's ordered top-level blocks (``model.layers.0`` ...): the integer-named children of the module
    that has the most of them (the shallowest on a tie), or of ``container`` if given."""
    children: dict[str, set] = {}
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        if leaf.isdigit() and (container is None or parent == container):
            children.setdefault(parent, set()).add(int(leaf))
    if not children:
        return container or "", []
    parent = max(children, key=lambda p: (len(children[p]), -p.count(".")))
    return parent, [f"{parent}.{i}" for i in sorted(children[parent])]
