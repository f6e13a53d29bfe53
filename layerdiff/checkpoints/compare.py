"""Two checkpoints compared parameter by parameter, names matched directly or through the matched modules."""
from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import numpy as np

from layerdiff.checkpoints import safetensors_io
from layerdiff.checkpoints.formats import Checkpoint, SafetensorsFiles, first_line
from layerdiff.checkpoints.open import open_checkpoint
from layerdiff.errors import LayerdiffError
from layerdiff.match import modules, paramplan
from layerdiff.match.layouts import canonical_param_name
from layerdiff.match.mapping import match_modules
from layerdiff.match.paramplan import ParamSource
from layerdiff.match.rename import RenameRules
from layerdiff.match.rules import RuleSet, ruleset
from layerdiff.tracefile.tensors import summarize


def _spill(ck: Checkpoint) -> Checkpoint:
    """Write a whole-loaded checkpoint to a temporary safetensors file and free it (one side in memory)."""
    tensors = {}
    for name in ck.names():
        arr, dtype = ck.load(name)
        if dtype not in safetensors_io.STORABLE_DTYPES:
            return ck  # cannot spill (complex): keep in memory
        tensors[name] = (arr, dtype)
    target = Path(tempfile.mkdtemp(prefix="layerdiff-ckpt-")) / "a.safetensors"
    safetensors_io.save(target, tensors)
    del tensors
    spilled = SafetensorsFiles(ck.path, [target])
    spilled.format, spilled.notes, spilled.spill_file = ck.format, ck.notes, target
    ck.close()
    return spilled


class _AtHome(Checkpoint):
    """A checkpoint whose moved parameters go by the name where they belong (``RuleSet.param_home``: Transformer
    Engine's ``linear_qkv.layer_norm_weight`` is ``input_layernorm.weight``); ``stored`` gives the file's name."""

    def __init__(self, ck: Checkpoint, rules: RuleSet):
        super().__init__(ck.path)
        self.ck, self.format, self.notes, self.whole = ck, ck.format, ck.notes, ck.whole
        self._stored = rules.param_homes(ck.names())
        self._index = {home: ck.info(name) for home, name in self._stored.items()}

    def stored(self, name: str) -> str:
        return self._stored.get(name, name)

    def _load(self, name):
        return self.ck.load(self._stored[name])


def _l2(a_raw, b_raw, dtype_a, dtype_b) -> float:
    from layerdiff.tracefile.tensors import as_float
    a, b = as_float(a_raw, dtype_a).reshape(-1), as_float(b_raw, dtype_b).reshape(-1)
    total = 0.0
    for i in range(0, a.size, 1 << 20):
        d = a[i:i + (1 << 20)].astype(np.float64) - b[i:i + (1 << 20)].astype(np.float64)
        total += float(np.dot(d, d))
    return math.sqrt(total)


def _stored_transposed(xa: np.ndarray, xb: np.ndarray, dtype_a: str, dtype_b: str) -> bool:
    """A square weight that one checkpoint stores [in, out] (GPT-2's ``Conv1D``) has no shape to tell it: its values
    do, where its transpose is ten times closer to the other's than it is (a defect in it stays a difference)."""
    if xa.ndim != 2 or xb.shape != xa.shape or xa.shape[0] != xa.shape[1] or xa.shape[0] < 2 or \
            np.array_equal(xa, xb):
        return False
    return _l2(xa, np.ascontiguousarray(xb.T), dtype_a, dtype_b) * 10 < _l2(xa, xb, dtype_a, dtype_b)


def diff(a: Checkpoint, b: Checkpoint, *, mapping: RenameRules | None = None, exact: bool = False,
         transpose=None, rules: RuleSet | None = None) -> dict:
    """Compare every parameter of ``b`` (renamed into ``a``'s names) with ``a``.

    Names match after ``canonical_param_name`` (gamma/beta/embedding_table aliases) and ``mapping`` (B -> A).
    ``transpose``: regexes (on A's names) whose B tensor is compared transposed; without one, a 2-D B tensor
    whose shape is A's transposed is compared transposed and marked ``"transposed": true``, and so is a square one
    whose transpose is ten times closer to A's than it is (``_stored_transposed``).
    A parameter is "identical" when max_diff == 0 and no NaN/Inf differs, "different" otherwise; without
    ``exact``, a different parameter also gets ``within_tolerance`` (layerdiff's default per-dtype
    tolerances, e.g. fp32 atol 1e-8 + rtol 2e-5, cos 0.99999), for information only. ``exact`` drops that
    and also counts a dtype change with equal values as a difference.
    Returns ``{name: {"l2", "cos", "max_diff", "mean_diff", "numel", "shape", "dtype", ...}, "__summary__":
    {...}}`` in A's names.
    """
    from layerdiff.compare.metrics import compare_arrays
    rename, rules = mapping or RenameRules(), rules or ruleset()
    if a.whole and b.whole:
        a = _spill(a)
    a, b = _AtHome(a, rules), _AtHome(b, rules)
    patterns = _transpose_patterns(transpose)
    a_names = {canonical_param_name(n): n for n in a.names()}
    b_to_a: dict[str, str] = {}
    for n in b.names():
        key = canonical_param_name(rename(n))
        if key in b_to_a:
            raise LayerdiffError(f"{b.path}: {n!r} and {b_to_a[key]!r} both map to {key!r}")
        b_to_a[key] = n
    plans, groups, missing, extra = _plan_names(a, b, a_names, b_to_a, rename, rules)
    from layerdiff.compare.tolerance import DEFAULTS, dtype_class, judge
    result, identical, different, max_all, shape_mismatch, near = {}, 0, 0, 0.0, [], 0
    for source in plans:
        na = source.name
        dta, sha = a.info(na)
        shown = a.stored(na)
        entry = {"numel": int(np.prod(sha, dtype=np.int64)), "shape": list(sha), "dtype": dta}
        xa, _ = a.load(na)
        if source.op == "same":
            dtb, shb = b.info(source.sources[0])
            xb, _ = b.load(source.sources[0])
            nb = b.stored(source.sources[0])
        else:  # one part of B's fused parameter, or B's parts merged
            nb = source.describe()
            dtb = b.info(source.sources[0])[0]
            xb = paramplan.build(source, lambda n: paramplan.rows_first(b.load(n)[0], xa), groups[na])
            shb = list(xb.shape)
        if nb != shown:
            entry["b_name"] = nb
        if dtb != dta:
            entry["dtype_b"] = dtb
        forced = any(p.search(na) for p in patterns)
        if forced or (list(shb) != list(sha) and len(sha) == 2 and list(shb) == list(sha)[::-1]) or \
                _stored_transposed(xa, xb, dta, dtb):
            if len(shb) != 2:
                raise LayerdiffError(f"{shown}: transpose rule matches a {len(shb)}-D tensor")
            xb = xb.T
            entry["transposed"] = True
        if list(xb.shape) != list(sha):
            entry.update({"status": "shape_mismatch", "shape_b": list(shb)})
            shape_mismatch.append(shown)
            different += 1
            result[shown] = entry
            continue
        if dta in ("complex64", "complex128") or dtb in ("complex64", "complex128"):
            raise LayerdiffError(f"{shown}: complex tensors are not compared")
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
        max_abs = m.get("max_abs")
        if max_abs is not None and math.isfinite(max_abs):
            max_all = max(max_all, max_abs)
        result[shown] = entry
        del xa, xb
    result["__summary__"] = {
        "a": str(a.path), "b": str(b.path), "format_a": a.format, "format_b": b.format,
        "compared": len(plans), "identical": identical, "different": different,
        "different_within_tolerance": near,
        "shape_mismatch": shape_mismatch, "missing_in_b": sorted(map(a.stored, missing)),
        "extra_in_b": sorted(map(b.stored, extra)),
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
            raise LayerdiffError(f"bad --transpose {shown!r}: {first_line(exc)[:100]}") from None
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
                                          {n: tuple(b.info(n)[1]) for n in b.names()}, "a", rules)
    plans = [paramplan.inferred_regroup(p, rules, a.load(p.name)[0], b.load(p.sources[0])[0])
             if p.op == "relayout" else p for p in plans]  # two checkpoints name no heads: their values tell
    groups = {p.name: paramplan.group_count(p, rules, [], load=lambda n: b.load(n)[0],
                                            own_load=lambda n: a.load(n)[0]) for p in plans if p.op != "same"}
    return plans, groups, sorted(missing), sorted(n for n in b.names() if n not in used)


def _stats(ck: Checkpoint, name: str) -> dict:
    values, dtype = ck.load(name)
    return summarize(values, dtype)


def _cleanup(ck: Checkpoint):
    ck.close()
    tmp = ck.spill_file
    if tmp is not None:
        tmp.unlink(missing_ok=True)
        try:
            tmp.parent.rmdir()
        except OSError:
            pass


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
