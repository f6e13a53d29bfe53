"""How the same model looks in different frameworks: type families, parameter names and layouts.

Declarative tables, so a new layer type is a line here, not a special case in the aligner; what a framework names
or stores differently (Paddle's [in, out] Linear weight, MindSpore's ``Dense``) is in its rule set. Nothing here
imports a framework.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np

# Lower-cased class name patterns -> family, in PyTorch's and Hugging Face's names (other frameworks' class names
# are in their rule sets: match/rulesets). The first match wins; unknown types are their own family.
TYPE_FAMILIES = [
    (r"^linear$", "linear"),
    (r"^embedding$", "embedding"),
    (r"rmsnorm", "rmsnorm"),
    (r"^(layernorm|fusedlayernorm)$", "layernorm"),
    (r"(silu|siluactivation|swish)$", "silu"),
    (r"^(gelu|geluactivation|newgeluactivation|fastgeluactivation)$", "gelu"),
    (r"^relu$", "relu"),
    (r"^(modulelist|sequential)$", "list"),
    (r"^dropout$", "dropout"),
    (r"rotary", "rotary"),
    (r"(dotproductattention|coreattention|sdpaattention)$", "core_attention"),
    (r"^transformerblock$", "stack"),
    (r"(decoderlayer|decodelayer|encoderlayer|^transformerlayer$|^bertlayer$|block$)", "layer"),
    (r"attention$", "attention"),
    (r"(mlp|feedforward)$", "mlp"),
    (r"router$", "router"),  # an MoE layer's router: Megatron's TopKRouter, HF's MixtralTopKRouter (named "gate")
]
# Families that stand in for each other: a port that swaps one activation for another is the defect to find.
ACTIVATION_FAMILIES = {"silu", "gelu", "relu", "tanh", "sigmoid", "quickgelu", "mish", "relu2", "leakyrelu"}
_FAMILY_PATTERNS = [(re.compile(p), f) for p, f in TYPE_FAMILIES]

# Parameter leaf names that mean the same thing ("norm.gamma" is "norm.weight").
PARAM_ALIASES = {"gamma": "weight", "beta": "bias", "embedding_table": "weight", "embedding_weight": "weight",
                 "moving_mean": "running_mean",
                 "moving_variance": "running_var"}

def type_family(type_name: str | None) -> str:
    name = (type_name or "").lower()
    for pattern, family in _FAMILY_PATTERNS:
        if pattern.search(name):
            return family
    return name


def canonical_param_name(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    leaf = PARAM_ALIASES.get(leaf, leaf)
    return f"{module}.{leaf}" if module else leaf


class LayoutRules:
    """User-declared layout transforms applied to trace B's tensors before comparison:
    ``REGEX=transpose``, ``REGEX=permute(3,2,0,1)`` or ``REGEX=reshape(-1,64)``, matched (``re.search``)
    against the record's path in A's names (a parameter name, or a module path)."""

    _SPEC = re.compile(r"^(transpose|permute|reshape)(?:\(([-\d,\s]*)\))?$")

    def __init__(self, specs: Iterable[str] | None = ()) -> None:
        self.rules = []
        for spec in specs or ():
            pattern, eq, transform = spec.rpartition("=")
            m = self._SPEC.match(transform.strip())
            if not eq or not pattern or m is None:
                raise ValueError(f"layout rule {spec!r} should look like 'REGEX=transpose', 'REGEX=permute(1,0)' "
                                 "or 'REGEX=reshape(-1,64)'")
            args = tuple(int(x) for x in (m.group(2) or "").split(",") if x.strip())
            if m.group(1) != "transpose" and not args:
                raise ValueError(f"layout rule {spec!r}: {m.group(1)} needs its dimensions")
            self.rules.append((re.compile(pattern), m.group(1), args, transform.strip()))

    def find(self, path: str):
        """(name, args, text) of the first rule matching ``path``, or None."""
        for pattern, name, args, text in self.rules:
            if pattern.search(path):
                return name, args, text
        return None

    @staticmethod
    def apply(rule, array):
        name, args, _ = rule
        if name == "transpose":
            return array.T
        if name == "permute":
            return array.transpose(args)
        return array.reshape(args)

    @staticmethod
    def invert(rule, array, shape):
        """A's tensor in B's layout (the inverse of ``apply``): replay feeds B the reference's values."""
        name, args, _ = rule
        if name == "transpose":
            return array.T
        if name == "permute":
            return array.transpose([args.index(i) for i in range(len(args))])
        return array.reshape(shape)

    def as_list(self):
        return [[p.pattern, text] for p, _, _, text in self.rules]


# ---------------------------------------------------------------------------------------------------------
# Per-tensor layouts inferred from shapes
# ---------------------------------------------------------------------------------------------------------
def _squeezed(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def _subsequence_at(small: tuple, big: tuple):
    """Positions in ``big`` holding ``small`` in order, rightmost first (numpy's broadcasting alignment)."""
    positions, j = [], len(big) - 1
    for d in reversed(small):
        while j >= 0 and big[j] != d:
            j -= 1
        if j < 0:
            return None
        positions.append(j)
        j -= 1
    return positions[::-1]


@dataclass(frozen=True)
class ShapeRelation:
    """How B's tensor lines up with A's: the same shape, a reshape (size-1 dims, flattening), a permutation of
    dimensions ([s, b, h] vs [b, s, h]) or broadcasting ([s, 1, 1, d] vs [b, s, d]). ``ambiguous`` marks a pair
    whose shapes allow several permutations (a dimension size that repeats) and that was compared in order."""

    kind: str  # "same" | "reshape" | "permute" | "broadcast" | "mismatch"
    shape_a: tuple
    shape_b: tuple
    perm: tuple = ()  # permute: A's i-th squeezed dim is B's squeezed dim perm[i]
    ambiguous: bool = False
    b_view: tuple = ()  # permute: B's shape to permute, when it is not B's own (tokens flattened: [s * b, h])
    # broadcast, of gradients: the larger side summed over the dimensions the smaller is broadcast along (the
    # gradient of a tensor used broadcast, GPT-2's positions' [1, s, h] added to [b, s, h], is the sum of the other's)
    summed: bool = False

    @property
    def ok(self) -> bool:
        return self.kind != "mismatch"

    def note(self) -> str | None:
        if self.kind == "permute":
            return f"B's {list(self.shape_b)} compared as A's {list(self.shape_a)} (dimensions reordered)"
        if self.kind == "reshape" and math.prod(self.shape_a) == math.prod(self.shape_b) \
                and _squeezed(self.shape_a) != _squeezed(self.shape_b):
            return f"shapes differ ({list(self.shape_a)} vs {list(self.shape_b)}); compared flattened"
        if self.kind == "broadcast" and self.summed:
            return (f"shapes differ ({list(self.shape_a)} vs {list(self.shape_b)}); gradients compared with the "
                    "larger summed over the dimensions the smaller is broadcast along")
        if self.kind == "broadcast":
            return f"shapes differ ({list(self.shape_a)} vs {list(self.shape_b)}); compared after broadcasting"
        if self.ambiguous:
            return "dimension sizes repeat: compared in order (declare a --layout rule if the order differs)"
        return None

    def views(self, a: np.ndarray, b: np.ndarray):
        """(A's values, B's values) in one common shape."""
        if self.kind in ("same", "reshape"):
            return a.reshape(-1), b.reshape(-1)
        if self.kind == "permute":
            return a.reshape(-1), b.reshape(self.b_view or _squeezed(self.shape_b)).transpose(self.perm).reshape(-1)
        sa, sb = _squeezed(self.shape_a), _squeezed(self.shape_b)
        at = _subsequence_at(sb, sa)
        if at is not None and self.summed:  # B is the smaller: A summed over the other dimensions
            rest = tuple(i for i in range(len(sa)) if i not in at)
            return a.reshape(sa).sum(axis=rest, dtype=np.float64).reshape(-1), b.reshape(-1)
        if at is not None:  # B broadcasts into A
            shape = [1] * len(sa)
            for pos, d in zip(at, sb):
                shape[pos] = d
            return a.reshape(sa), np.broadcast_to(b.reshape(shape), sa)
        at = _subsequence_at(sa, sb)
        if at is not None and self.summed:
            rest = tuple(i for i in range(len(sb)) if i not in at)
            return a.reshape(-1), b.reshape(sb).sum(axis=rest, dtype=np.float64).reshape(-1)
        if at is not None:
            shape = [1] * len(sb)
            for pos, d in zip(at, sa):
                shape[pos] = d
            return np.broadcast_to(a.reshape(shape), sb), b.reshape(sb)
        common = np.broadcast_shapes(self.shape_a, self.shape_b)
        return np.broadcast_to(a, common), np.broadcast_to(b, common)

    def to_b(self, a: np.ndarray) -> np.ndarray | None:
        """A's values laid out as B's tensor (replay feeds the candidate the reference's numbers)."""
        if self.kind in ("same", "reshape"):
            return a.reshape(self.shape_b)
        if self.kind == "permute":
            inverse = tuple(int(i) for i in np.argsort(self.perm))
            view = self.b_view or _squeezed(self.shape_b)
            permuted = tuple(view[i] for i in self.perm)  # A's values in B's dimensions, ordered as A's
            return np.ascontiguousarray(a.reshape(permuted).transpose(inverse)).reshape(self.shape_b)
        if self.kind == "broadcast":
            sa, sb = _squeezed(self.shape_a), _squeezed(self.shape_b)
            at = _subsequence_at(sb, sa)
            if at is not None:  # B is the smaller: A's first slice along the broadcast dimensions
                index = tuple(slice(None) if i in at else 0 for i in range(len(sa)))
                return np.ascontiguousarray(a.reshape(sa)[index]).reshape(self.shape_b)
            at = _subsequence_at(sa, sb)
            if at is not None:
                shape = [1] * len(sb)
                for pos, d in zip(at, sa):
                    shape[pos] = d
                return np.ascontiguousarray(np.broadcast_to(a.reshape(shape), sb)).reshape(self.shape_b)
            try:
                return np.ascontiguousarray(np.broadcast_to(a, self.shape_b))
            except ValueError:
                return None
        return None


@dataclass(frozen=True)
class TokenOrder:
    """Exactly one side (``sequence_first``: "a" or "b") orders its tokens sequence-first ([s, b, h], and
    [s * b, h] when flattened, as inside Megatron); ``batch`` x ``seq`` tokens per step. ``groups``: that side's
    flattened tokens are the blocks of ``groups`` ranks that each ran batch / groups sequences (data or expert
    parallel ranks joined), each block sequence-first."""

    sequence_first: str
    batch: int
    seq: int
    groups: int = 1


def relate_shapes(shape_a, shape_b, swap_leading: "bool | TokenOrder" = False) -> ShapeRelation:
    """How to compare a tensor of ``shape_a`` with one of ``shape_b``, inferred from the shapes alone.

    ``swap_leading`` is the declared hint that exactly one side is sequence-first: used when the shapes alone
    cannot tell (batch size equal to sequence length). As a ``TokenOrder`` it also relates flattened tokens
    ([b * s, ...] vs [s * b, ...]: an MoE router's input and logits), which shapes alone never could."""
    a, b = tuple(shape_a), tuple(shape_b)
    if swap_leading and len(a) == len(b) >= 3 and a[0] == b[1] and a[1] == b[0] and a[2:] == b[2:] \
            and 1 not in (a[0], a[1]):
        return ShapeRelation("permute", a, b, (1, 0) + tuple(range(2, len(_squeezed(b)))))
    if isinstance(swap_leading, TokenOrder):
        relation = _tokens_reordered(a, b, swap_leading)
        if relation is not None:
            return relation
    if a == b:
        return ShapeRelation("same", a, b)
    sa, sb = _squeezed(a), _squeezed(b)
    if sa == sb:
        return ShapeRelation("reshape", a, b)
    if math.prod(a) == math.prod(b):
        if sorted(sa) == sorted(sb) and len(sa) <= 6 and sa != sb:
            perms = [p for p in itertools.permutations(range(len(sb))) if all(sb[p[i]] == sa[i] for i in range(len(sa)))]
            if len(perms) == 1:
                return ShapeRelation("permute", a, b, perms[0])
            # dimensions of one size keep their order ([s, b, h, d] against [b, h, s, d] with s == d: s is the
            # first of the two in both); before, such a pair was compared flattened, which matched nothing
            in_order = [p for p in perms if all(p[i] < p[j] for i in range(len(sa)) for j in range(i + 1, len(sa))
                                                if sa[i] == sa[j])]
            return ShapeRelation("permute", a, b, in_order[0], ambiguous=True)
        return ShapeRelation("reshape", a, b)
    if _subsequence_at(sb, sa) is not None or _subsequence_at(sa, sb) is not None:
        return ShapeRelation("broadcast", a, b)
    try:
        np.broadcast_shapes(a, b)
        return ShapeRelation("broadcast", a, b)
    except ValueError:
        return ShapeRelation("mismatch", a, b)


def layouts_relate(shape_a, shape_b) -> bool:
    """Whether two shapes hold their elements in a relation ``relate_shapes`` knows to compare by: the same shape,
    a permutation, broadcasting, or a reshape that only merges or splits neighbouring dimensions (one side's running
    products of its dimensions are among the other's). Not two equal element counts alone: [1, 12, 8] against
    [2, 4, 12] compares nothing with its counterpart once flattened.

    Why: equal statistics are strong evidence that two operations of different kinds are one (a port's ``einsum``
    against ``matmul``), but not when their layouts are unrelated. A rotary embedding's ``cat`` of one batch held the
    same values, in another order, as the other side's ``matmul`` over two batches, and was paired with it."""
    relation = relate_shapes(shape_a, shape_b)
    if relation.kind in ("same", "permute", "broadcast"):
        return True
    if relation.kind != "reshape":
        return False
    running_a, running_b = _running_products(shape_a), _running_products(shape_b)
    return running_a <= running_b or running_b <= running_a


def _running_products(shape) -> set[int]:
    out, product = set(), 1
    for size in _squeezed(shape):
        product *= size
        out.add(product)
    return out


def _tokens_reordered(a: tuple, b: tuple, order: TokenOrder) -> ShapeRelation | None:
    """A and B both lead with the step's tokens ([b, s], [s, b] or flattened), in opposite orders: B's tokens
    viewed as B orders them and swapped into A's order."""
    tokens = order.batch * order.seq
    batch_first: tuple[int, ...]
    seq_first: tuple[int, ...]
    if order.groups > 1 and order.batch % order.groups == 0:  # blocks of ranks: within each, [s, b / groups]
        local = order.batch // order.groups
        batch_first, seq_first = (order.groups, local, order.seq), (order.groups, order.seq, local)
    elif order.batch < 2 or order.seq < 2:
        return None
    else:
        batch_first, seq_first = (order.batch, order.seq), (order.seq, order.batch)
    lead_a, lead_b = (seq_first, batch_first) if order.sequence_first == "a" else (batch_first, seq_first)

    def rest(shape, lead):
        return shape[1:] if shape[:1] == (tokens,) else shape[2:] if shape[:2] == lead else None

    rest_a, rest_b = rest(a, lead_a), rest(b, lead_b)
    if rest_a is None or rest_b is None or math.prod(rest_a) != math.prod(rest_b):
        return None
    # the dimensions after the tokens may be split otherwise ([s, b, groups, heads * d] against [b, s, hidden]):
    # in the same order in memory, so B's view keeps its own and the tokens are swapped before they
    view = lead_b + _squeezed(rest_b)
    swapped = (0, 2, 1) if len(lead_b) == 3 else (1, 0)
    return ShapeRelation("permute", a, b, swapped + tuple(range(len(lead_b), len(view))), b_view=view)
