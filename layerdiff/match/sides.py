"""One trace as pairing sees it: its records indexed by call and parameter, and what its metadata and the rule set
say about how it lays out tensors (sequence-first activations, transposed weights, shifted labels)."""
from __future__ import annotations

from dataclasses import dataclass

from layerdiff.match.layouts import TokenOrder, canonical_param_name
from layerdiff.match.operands import Operand, dtype_kind
from layerdiff.match.rules import RuleSet

PARAM_KINDS = ("param", "param_grad", "param_grad_use")
RECORD_KINDS = ("call",) + PARAM_KINDS
ROLE_ORDER = ("input", "output", "grad_output", "grad_input", "param", "param_grad")


# ---------------------------------------------------------------------------------------------------------
# One trace, as pairing sees it
# ---------------------------------------------------------------------------------------------------------
@dataclass
class TraceSide:
    """A trace's records indexed for pairing, with what its metadata says about layouts."""

    records: list
    meta: dict
    rules: RuleSet
    reader: object = None  # to read parameter values (checking a fused layout against the weights)

    def __post_init__(self):
        self.framework = self.meta.get("framework")
        self.model_class = self.meta.get("model_class")
        self.sequence_first = self.rules.is_sequence_first(self.model_class)
        self.bool_masked = self.rules.bool_mask_means_masked(self.model_class)
        self.labels_shifted = self.rules.labels_shifted(self.model_class)
        self.calls, self.params, self.types, self.children = {}, {}, {}, {}
        for r in self.records:
            if r["kind"] == "call":
                self.calls.setdefault((r["phase"], r["path"], r["call"]), r)
                self.types.setdefault(r["path"], r.get("type"))
                if r["phase"] == "forward" and r["call"] == 0 and r.get("parent"):
                    self.children.setdefault(r["parent"][0], []).append(r["path"])
            elif r["kind"] in PARAM_KINDS:  # param_grad_use: "call" is the using module's call
                module = r.get("module", r["path"].rpartition(".")[0])
                leaf = canonical_param_name(r["path"]).rpartition(".")[2]
                self.params.setdefault((r["kind"], module, leaf, r["call"]), r)
                if r.get("module_type"):
                    self.types.setdefault(module, r["module_type"])
        self.tokens = self._token_shape()

    def transposed(self, rec: dict, entry: dict) -> bool:
        """A parameter (or its gradient) this framework stores transposed relative to PyTorch."""
        return (rec["kind"] in PARAM_KINDS and len(entry["shape"]) == 2
                and self.rules.is_transposed(self.framework, self.types.get(rec.get("module")), rec["path"]))

    def operand(self, rec: dict, entry: dict) -> Operand:
        return Operand.stored(entry, self.transposed(rec, entry))

    def twin(self, rec: dict, path: str) -> dict | None:
        """The record of module ``path`` of the same kind, phase and call (or parameter leaf and count)."""
        if rec["kind"] == "call":
            return self.calls.get((rec["phase"], path, rec["call"]))
        leaf = canonical_param_name(rec["path"]).rpartition(".")[2]
        return self.params.get((rec["kind"], path, leaf, rec["call"]))

    def hparams(self, path: str) -> dict:
        rec = self.calls.get(("forward", path, 0))
        return (rec or {}).get("hparams") or {}

    def parent(self, path: str) -> str | None:
        rec = self.calls.get(("forward", path, 0))
        return rec["parent"][0] if rec and rec.get("parent") else None

    def _token_shape(self) -> tuple | None:
        """(batch, sequence) of the step: the shape of the root's first 2-D integer input (token ids)."""
        rec = self.calls.get(("forward", "", 0))
        for t in (rec or {}).get("tensors", ()):
            if t["role"] == "input" and len(t["shape"]) == 2 and dtype_kind(t["dtype"]) == "int":
                return tuple(t["shape"])
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


def torch_shape(rec, entry, side: TraceSide) -> tuple:
    shape = tuple(entry["shape"])
    return shape[::-1] if side.transposed(rec, entry) else shape
