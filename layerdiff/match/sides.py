"""One trace as pairing sees it: its records indexed by call and parameter, and what its metadata and the rule set
say about how it lays out tensors (sequence-first activations, transposed weights, shifted labels)."""
from __future__ import annotations

from dataclasses import dataclass

from layerdiff.match.layouts import TokenOrder, canonical_param_name
from layerdiff.match.operands import Operand, dtype_kind
from layerdiff.match.rules import RuleSet
from layerdiff.tracefile.records import CallRecord, ParamRecord, Record, TensorEntry

ROLE_ORDER = ("input", "output", "grad_output", "grad_input", "param", "param_grad")


# ---------------------------------------------------------------------------------------------------------
# One trace, as pairing sees it
# ---------------------------------------------------------------------------------------------------------
@dataclass
class TraceSide:
    """A trace's records indexed for pairing, with what its metadata says about layouts."""

    records: list[Record]
    meta: dict
    rules: RuleSet
    reader: object = None  # to read parameter values (checking a fused layout against the weights)

    def __post_init__(self):
        self.framework = self.meta.get("framework")
        self.model_class = self.meta.get("model_class")
        self.sequence_first = self.rules.is_sequence_first(self.model_class)
        self.bool_masked = self.rules.bool_mask_means_masked(self.model_class)
        self.labels_shifted = self.rules.labels_shifted(self.model_class)
        self.bias_beside = self.rules.returns_bias_beside(self.model_class)
        self.calls: dict[tuple, CallRecord] = {}
        self.params: dict[tuple, ParamRecord] = {}
        # parameters kept in another module than the one they belong to (``moved_params``), by where they belong
        self.moved: dict[tuple, ParamRecord] = {}
        # module -> the modules outside it where parameters it keeps belong: it runs their work inside itself
        self.moved_homes: dict[str, list[str]] = {}
        self.types: dict[str, str | None] = {}
        self.children: dict[str, list[str]] = {}  # forward
        self.backward_children: dict[str, list[str]] = {}  # modules seen in backward only, under their parent
        for r in self.records:
            if isinstance(r, CallRecord):
                self.calls.setdefault((r.phase, r.path, r.call), r)
                self.types.setdefault(r.path, r.type)
                if r.phase == "forward" and r.call == 0 and r.parent:
                    self.children.setdefault(r.parent[0], []).append(r.path)
                elif r.phase == "backward" and r.parent and ("forward", r.path, r.call) not in self.calls:
                    inner = self.backward_children.setdefault(r.parent[0], [])  # a custom-backward cell
                    if r.path not in inner:
                        inner.append(r.path)
            else:  # param_grad_use: "call" is the using module's call
                module = r.module_path
                leaf = canonical_param_name(r.path).rpartition(".")[2]
                self.params.setdefault((r.kind, module, leaf, r.call), r)
                home = self.rules.param_home(r.path) if self.rules.moved_params else r.path
                if home != r.path:
                    home_module, _, home_leaf = home.rpartition(".")
                    self.moved.setdefault((r.kind, home_module, home_leaf, r.call), r)
                    homes = self.moved_homes.setdefault(module, [])
                    if home_module not in homes and not (home_module + ".").startswith(module + "."):
                        homes.append(home_module)
                if r.module_type:
                    self.types.setdefault(module, r.module_type)
        self.tokens = self._token_shape()

    def transposed(self, rec: Record, entry: TensorEntry) -> bool:
        """A parameter (or its gradient) this framework stores transposed relative to PyTorch."""
        return (isinstance(rec, ParamRecord) and len(entry.shape) == 2
                and self.rules.is_transposed(self.framework, self.types.get(rec.module or ""), rec.path))

    def operand(self, rec: Record, entry: TensorEntry) -> Operand:
        return Operand.stored(entry, self.transposed(rec, entry))

    def twin(self, rec: Record, path: str) -> Record | None:
        """The record of module ``path`` of the same kind, phase and call (or parameter leaf and count)."""
        if isinstance(rec, CallRecord):
            return self.calls.get((rec.phase, path, rec.call))
        leaf = canonical_param_name(rec.path).rpartition(".")[2]
        return self.params.get((rec.kind, path, leaf, rec.call))

    def home_twin(self, rec: ParamRecord, other: TraceSide, counterparts) -> ParamRecord | None:
        """This side's record of the parameter that ``rec`` (a parameter record of ``other``) is, where one of the
        two runs keeps it in another module than the one it belongs to (the rule set's ``moved_params``: Megatron's
        ``shared_experts.gate_weight`` is transformers' ``shared_expert_gate.weight``). ``counterparts(path)``: this
        side's modules matched to ``other``'s module ``path``; the parameter's module is found through its
        parent's."""
        home = other.rules.param_home(rec.path)
        module, _, leaf = home.rpartition(".")
        parent, _, local = module.rpartition(".")
        for here in counterparts(parent):
            key = (rec.kind, f"{here}.{local}", leaf, rec.call)
            found = self.params.get(key) or self.moved.get(key)
            if found is not None and found.module_path != rec.module_path:
                return found
        return None

    def hparams(self, path: str) -> dict:
        rec = self.calls.get(("forward", path, 0))
        return (rec.hparams if rec is not None else None) or {}

    def parent(self, path: str) -> str | None:
        rec = self.calls.get(("forward", path, 0))
        return rec.parent[0] if rec is not None and rec.parent else None

    def _token_shape(self) -> tuple | None:
        """(batch, sequence) of the step: the shape of the root's first 2-D integer input (token ids)."""
        rec = self.calls.get(("forward", "", 0))
        for t in rec.tensors if rec is not None else ():
            if t.role == "input" and len(t.shape) == 2 and dtype_kind(t.dtype) == "int":
                return tuple(t.shape)
        return None


def token_order(side_a: TraceSide, side_b: TraceSide) -> "TokenOrder | bool":
    """How the two runs order their tokens: False when alike; when exactly one is sequence-first, a
    ``TokenOrder`` (or True, if neither run's token ids give the batch and sequence sizes)."""
    if side_a.sequence_first == side_b.sequence_first:
        return False
    tokens = side_a.tokens or side_b.tokens
    if tokens is None:
        return True
    return TokenOrder("a" if side_a.sequence_first else "b", *tokens)


def torch_shape(rec: Record, entry: TensorEntry, side: TraceSide) -> tuple:
    shape = tuple(entry.shape)
    return shape[::-1] if side.transposed(rec, entry) else shape
