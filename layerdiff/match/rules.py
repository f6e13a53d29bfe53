"""How ports name, fuse and represent the same model: one rule set, read by mapping, align, replay, weight transfer
and checkpoint diff.

A rule set is plain data with six parts:

- ``names``: synonyms for module names (``wq`` ~ ``q_proj`` ~ ``query``; ``parent.name`` where the name alone is
  ambiguous), as canonical tokens;
- ``families``: extra class-name patterns for type families (``ColumnParallelLinear`` is a ``linear``);
- ``fused``: one module on one side that is several on the other (Megatron ``linear_qkv`` = q, k, v per query
  group), with where its group count comes from;
- ``moved_params``: parameters kept inside another module than the one that uses them (Transformer Engine keeps
  the attention norm's weight in ``linear_qkv`` as ``layer_norm_weight``), named where they belong;
- ``transposed``: parameters a framework stores transposed relative to PyTorch (Paddle's Linear weight is
  [in, out]), by framework, type family and parameter name: never guessed from shapes;
- value representations: rotary tables as angles vs their cos and sin (``rotary``), boolean vs additive masks
  (``masks``), sequence-first activations ([s, b, h], ``sequence_first``) and labels shifted by the data pipeline
  (``shifted_labels``), and modules that return their bias beside their output for the caller to add
  (``bias_beside_output``: Megatron's ``(output, bias)``), each by model class.

The built-in rules are in ``match/rulesets`` (one file per ecosystem); users add their own in a TOML file with the
same schema (``--rules FILE``, documented in docs/concepts/rule-files.md). Nothing here imports a framework.
"""
from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from layerdiff.errors import LayerdiffError
from layerdiff.match.layouts import canonical_param_name
from layerdiff.match.layouts import type_family as builtin_family


@dataclass(frozen=True)
class FusedRule:
    """``module`` (a regex on a module's own name) holds the parts ``parts`` (canonical tokens) back to back along
    its output features, in ``groups`` groups: [p0 of group 0, p1 of group 0, ..., p0 of group 1, ...].
    ``groups`` lists where the group count comes from, tried in order: integers, or hyper-parameter names looked
    up on the fused module and its parent (either side); without one, parameter values decide, else 1."""

    name: str
    module: re.Pattern
    parts: tuple
    groups: tuple = ()
    source: str = ""
    tp_every_part: bool = False  # a tensor-parallel shard holds a slice of every part (Megatron's fc1)

    def matches(self, local_name: str) -> bool:
        return bool(self.module.search(local_name))


@dataclass(frozen=True)
class AngleRule:
    """Rotary tables: one side hands on the angles, the other their cosine and sine. Key patterns name the tensors
    (``FAMILY:KEY`` limits a pattern to modules of that type family)."""

    name: str
    angles: tuple
    cos: tuple
    sin: tuple
    source: str = ""


@dataclass(frozen=True)
class MaskRule:
    """Attention masks: additive floats (0 / large negative) or booleans; ``bool_masked`` says whether True means
    "masked" for models of classes matching ``model_class`` (Megatron) or "attend" (PyTorch SDPA, HF)."""

    keys: tuple
    model_class: re.Pattern | None
    bool_masked: bool
    source: str = ""


@dataclass(frozen=True)
class FusedOpRule:
    """One operation on one side that is a sequence of them on the other (``scaled_dot_product_attention`` vs
    matmul, scale, mask, softmax, matmul): the sequence ends in an operation of a kind in ``ends`` and holds at
    most ``longest`` operations; the fused operation's output is compared with the sequence's last. ``holds``: kinds
    of which one must run in the sequence (``silu`` spelled out holds a ``sigmoid``: a ``gelu`` and the ``mul`` by
    the MLP's up projection are not it)."""

    op: str
    ends: tuple
    longest: int = 16
    source: str = ""
    holds: tuple = ()


@dataclass(frozen=True)
class RuleSet:
    names: dict = field(default_factory=dict)  # synonym (lower case) -> canonical token
    families: tuple = ()  # (compiled pattern, family)
    fused: tuple = ()
    angles: tuple = ()
    masks: tuple = ()
    sequence_first: tuple = ()  # compiled model-class patterns whose activations are [s, b, ...]
    shifted_labels: tuple = ()  # model classes whose "labels" input is already shifted left (last = -100)
    sources: tuple = ()
    moved_params: tuple = ()  # (compiled stored piece, home piece)
    transposed: tuple = ()  # (framework, type family, parameter leaf) stored [in, out]
    op_kinds: dict = field(default_factory=dict)  # operation kind synonym -> canonical kind (``true_divide``: div)
    pass_through_ops: frozenset = frozenset()  # kinds one side may add or leave out: casts, views, copies
    fused_ops: tuple = ()  # FusedOpRule
    op_arguments: dict = field(default_factory=dict)  # argument name synonym -> canonical name (``axis``: dim)
    bias_beside_output: tuple = ()  # model classes whose modules may return (output, bias) for the caller to add
    # type name -> family, filled as asked: every module of every trace asks, and the patterns are many
    _families_found: dict = field(default_factory=dict, compare=False, repr=False)

    def op_kind(self, kind: str) -> str:
        """The canonical kind of an operation: ``true_divide`` and ``div`` are both ``div``."""
        return self.op_kinds.get(kind, kind)

    def passes_through(self, kind: str) -> bool:
        """An operation that one side may insert or leave out without a difference in meaning (a cast, a view)."""
        return self.op_kind(kind) in self.pass_through_ops

    def fused_op(self, kind: str) -> FusedOpRule | None:
        canonical = self.op_kind(kind)
        return next((r for r in self.fused_ops if r.op == canonical), None)

    def is_transposed(self, framework: str | None, type_name: str | None, param_name: str) -> bool:
        """A parameter that ``framework`` stores transposed relative to PyTorch's layout, by the type of the module
        that owns it (a square weight looks the same either way: never guessed from shapes)."""
        if not self.transposed:
            return False
        leaf = canonical_param_name(param_name).rpartition(".")[2]
        return (framework, self.family(type_name), leaf) in self.transposed or \
            (framework, f"type:{type_name}", leaf) in self.transposed

    def param_home(self, name: str) -> str:
        """A parameter's name where it belongs: ``x.self_attention.linear_qkv.layer_norm_weight`` is
        ``x.input_layernorm.weight`` (the first ``moved_params`` entry found in the name, at a dot)."""
        for pattern, home in self.moved_params:
            moved, count = pattern.subn(lambda _: home, name, count=1)
            if count:
                return moved
        return name

    def param_homes(self, names) -> dict:
        """{name where it belongs: stored name} for ``names``; a moved name that would take the place of a
        stored one keeps its own (a model that has both is not fused)."""
        names = list(names)
        stored = set(names)
        homes = {}
        for name in names:
            home = self.param_home(name)
            homes[name if home in stored or home in homes else home] = name
        return homes

    def token(self, local_name: str, parent: str | None = None) -> str:
        """The canonical token of a module's own name: ``wq`` and ``q_proj`` are both ``q``. A synonym may name
        the module's parent too (``mlp.c_proj`` is ``down``, ``attn.c_proj`` is ``o``: GPT-2 calls both
        ``c_proj``); ``parent`` is the parent's own name."""
        name = local_name.lower()
        if parent:
            found = self.names.get(f"{parent.lower()}.{name}")
            if found is not None:
                return found
        return self.names.get(name, name)

    def family(self, type_name: str | None) -> str:
        """A class's type family: patterns match its lower-cased name, and one written with capitals its name as
        written (transformers' ``Conv1D``, a linear, is not torch's ``Conv1d``)."""
        found = self._families_found.get(type_name)
        if found is None:
            found = self._families_found[type_name] = self._family_by_patterns(type_name)
        return found

    def _family_by_patterns(self, type_name: str | None) -> str:
        name = (type_name or "").lower()
        for pattern, family in self.families:
            if pattern.search(name) or (type_name and pattern.search(type_name)):
                return family
        return builtin_family(type_name)

    def fused_rule(self, local_name: str) -> FusedRule | None:
        return next((r for r in self.fused if r.matches(local_name)), None)

    def is_sequence_first(self, model_class: str | None) -> bool:
        return bool(model_class) and any(p.search(model_class) for p in self.sequence_first)

    def returns_bias_beside(self, model_class: str | None) -> bool:
        """Whether the modules of ``model_class`` may return ``(output, bias)``, the bias not yet added (Megatron's
        linears with ``skip_bias_add``, its attention and MLP): what they compute is the sum."""
        return bool(model_class) and any(p.search(model_class) for p in self.bias_beside_output)

    def labels_shifted(self, model_class: str | None) -> bool:
        return bool(model_class) and any(p.search(model_class) for p in self.shifted_labels)

    def bool_mask_means_masked(self, model_class: str | None) -> bool:
        for rule in self.masks:
            if rule.model_class is not None and model_class and rule.model_class.search(model_class):
                return rule.bool_masked
        return False  # PyTorch SDPA and HF: True = attend

    def mask_keys(self) -> tuple:
        return tuple(k for rule in self.masks for k in rule.keys)

    def merged(self, other: "RuleSet") -> "RuleSet":
        """``other``'s rules first: a user's file overrides the built-in synonyms and patterns."""
        return RuleSet({**self.names, **other.names}, other.families + self.families, other.fused + self.fused,
                       other.angles + self.angles, other.masks + self.masks,
                       other.sequence_first + self.sequence_first, other.shifted_labels + self.shifted_labels,
                       self.sources + other.sources, other.moved_params + self.moved_params,
                       other.transposed + self.transposed, op_kinds={**self.op_kinds, **other.op_kinds},
                       pass_through_ops=self.pass_through_ops | other.pass_through_ops,
                       fused_ops=other.fused_ops + self.fused_ops,
                       op_arguments={**self.op_arguments, **other.op_arguments},
                       bias_beside_output=other.bias_beside_output + self.bias_beside_output)

    def describe(self) -> list:
        return list(self.sources)


def _compile(pattern, where: str) -> re.Pattern:
    if not isinstance(pattern, str):
        raise LayerdiffError(f"{where}: expected a regular expression string, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise LayerdiffError(f"{where}: bad regular expression {pattern!r}: {exc}") from None


def _strings(value, where: str) -> tuple:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise LayerdiffError(f"{where}: expected a string or a list of strings")
    return tuple(value)


_SECTIONS = {"names", "families", "fused", "rotary", "masks", "sequence_first", "shifted_labels", "moved_params",
             "transposed", "ops", "description", "bias_beside_output"}


_ENTRY_KEYS = {"fused": {"name", "module", "parts", "groups", "tp_shards"},
               "rotary": {"name", "angles", "cos", "sin"}, "masks": {"keys", "model_class", "bool_masked"},
               "transposed": {"framework", "family", "type", "params"}, "ops": {"same", "pass_through", "fused", "arguments"},
               "ops.fused": {"op", "ends", "longest", "holds"}}


def _check_keys(entry, section: str, where: str):
    """An unknown key in an entry is refused: in TOML a top-level key written after a table belongs to it."""
    unknown = set(entry) - _ENTRY_KEYS[section] if isinstance(entry, dict) else set()
    if unknown:
        raise LayerdiffError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (expected "
                             f"{', '.join(sorted(_ENTRY_KEYS[section]))}; top-level keys go before the first table)")


def from_dict(data: dict, source: str, *, listed: bool = True) -> RuleSet:
    """Validate and compile one rule set (built-in data or a user's TOML); every error names the entry. ``listed``:
    named by ``describe`` (a report's "rules")."""
    if not isinstance(data, dict):
        raise LayerdiffError(f"{source}: a rule file is a table of sections")
    unknown = set(data) - _SECTIONS
    if unknown:
        raise LayerdiffError(f"{source}: unknown section(s) {', '.join(sorted(unknown))}; expected "
                             f"{', '.join(sorted(_SECTIONS - {'description'}))}")
    names = {}
    for token, synonyms in (data.get("names") or {}).items():
        for s in _strings(synonyms, f"{source}: [names] {token}") + (token,):
            names[s.lower()] = token.lower()
    families = tuple((_compile(p, f"{source}: [families] {fam}"), fam)
                     for fam, patterns in (data.get("families") or {}).items()
                     for p in _strings(patterns, f"{source}: [families] {fam}"))
    fused = []
    for i, entry in enumerate(data.get("fused") or []):
        where = f"{source}: [[fused]] entry {i + 1}"
        _check_keys(entry, "fused", where)
        if not isinstance(entry, dict) or "module" not in entry or "parts" not in entry:
            raise LayerdiffError(f"{where}: needs 'module' (regex) and 'parts' (list of names)")
        parts = tuple(p.lower() for p in _strings(entry["parts"], where + " parts"))
        if len(parts) < 2:
            raise LayerdiffError(f"{where}: a fused module has at least two parts")
        groups = entry.get("groups", ())
        groups = (groups,) if isinstance(groups, (int, str)) else tuple(groups)
        if not all(isinstance(g, (int, str)) and not isinstance(g, bool) and (not isinstance(g, int) or g > 0)
                   for g in groups):
            raise LayerdiffError(f"{where}: 'groups' lists positive integers or hyper-parameter names")
        split = entry.get("tp_shards", "slice")
        if split not in ("slice", "every_part"):
            raise LayerdiffError(f"{where}: 'tp_shards' is \"slice\" (a shard is a slice of the fused tensor) or "
                                 "\"every_part\" (a shard holds a slice of every part)")
        fused.append(FusedRule(str(entry.get("name") or "+".join(parts)), _compile(entry["module"], where),
                               parts, groups, source, split == "every_part"))
    angles = []
    for i, entry in enumerate(data.get("rotary") or []):
        where = f"{source}: [[rotary]] entry {i + 1}"
        _check_keys(entry, "rotary", where)
        if not isinstance(entry, dict) or not {"angles", "cos", "sin"} <= set(entry):
            raise LayerdiffError(f"{where}: needs 'angles', 'cos' and 'sin' (tensor key patterns)")
        angles.append(AngleRule(str(entry.get("name", "rotary")), _strings(entry["angles"], where),
                                _strings(entry["cos"], where), _strings(entry["sin"], where), source))
    masks = []
    for i, entry in enumerate(data.get("masks") or []):
        where = f"{source}: [[masks]] entry {i + 1}"
        _check_keys(entry, "masks", where)
        if not isinstance(entry, dict) or "keys" not in entry:
            raise LayerdiffError(f"{where}: needs 'keys' (tensor names) and optionally model_class, bool_masked")
        model_class = entry.get("model_class")
        masks.append(MaskRule(_strings(entry["keys"], where),
                              _compile(model_class, where) if model_class is not None else None,
                              bool(entry.get("bool_masked", False)), source))
    sequence_first = tuple(_compile(p, f"{source}: sequence_first")
                           for p in _strings(data.get("sequence_first") or [], f"{source}: sequence_first"))
    shifted = tuple(_compile(p, f"{source}: shifted_labels")
                    for p in _strings(data.get("shifted_labels") or [], f"{source}: shifted_labels"))
    bias_beside = tuple(_compile(p, f"{source}: bias_beside_output")
                        for p in _strings(data.get("bias_beside_output") or [], f"{source}: bias_beside_output"))
    moved = data.get("moved_params") or {}
    if not isinstance(moved, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                              for k, v in moved.items()):
        raise LayerdiffError(f"{source}: [moved_params] maps a stored name piece to the piece where it belongs "
                             "(\"self_attention.linear_qkv.layer_norm_\" = \"input_layernorm.\")")
    moved_params = tuple((re.compile(r"(?:^|(?<=\.))" + re.escape(stored)), home) for stored, home in moved.items())
    transposed = []
    for i, entry in enumerate(data.get("transposed") or []):
        where = f"{source}: [[transposed]] entry {i + 1}"
        _check_keys(entry, "transposed", where)
        kind = "family" if isinstance(entry, dict) and "family" in entry else "type"
        if not isinstance(entry, dict) or not {"framework", kind, "params"} <= set(entry) or \
                not all(isinstance(entry[k], str) for k in ("framework", kind)):
            raise LayerdiffError(f"{where}: needs 'framework', 'family' (a type family such as \"linear\") or "
                                 "'type' (a class name, case and all) and 'params' (parameter names stored [in, out])")
        owner = entry["family"] if kind == "family" else f"type:{entry['type']}"
        transposed += [(entry["framework"], owner, leaf) for leaf in _strings(entry["params"], where)]
    op_kinds, pass_through, fused_ops, op_arguments = _ops_section(data.get("ops"), source)
    return RuleSet(names, families, tuple(fused), tuple(angles), tuple(masks), sequence_first, shifted,
                   (source,) if listed else (), moved_params, tuple(transposed), op_kinds=op_kinds,
                   pass_through_ops=pass_through, fused_ops=fused_ops, op_arguments=op_arguments,
                   bias_beside_output=bias_beside)


def _ops_section(section, source: str) -> tuple[dict, frozenset, tuple, dict]:
    """``[ops]``: ``same`` (canonical kind = [synonyms]), ``pass_through`` (kinds one side may add or leave out),
    ``[[ops.fused]]`` (``op``, ``ends``, ``longest``, ``holds``) and ``arguments`` (argument name = the name every
    framework's call is compared under: ``axis = "dim"``)."""
    if section is None:
        return {}, frozenset(), (), {}
    where = f"{source}: [ops]"
    if not isinstance(section, dict):
        raise LayerdiffError(f"{where}: a table with same, pass_through and fused")
    _check_keys(section, "ops", where)
    same = section.get("same") or {}
    if not isinstance(same, dict):
        raise LayerdiffError(f"{where} same: a table of canonical kind = [synonyms]")
    kinds = {syn: canonical for canonical, synonyms in same.items()
             for syn in _strings(synonyms, f"{where} same.{canonical}")}
    def canonical_of(kind: str) -> str:
        return kinds.get(kind, kind)

    pass_through = frozenset(canonical_of(k) for k in _strings(section.get("pass_through") or [],
                                                                  f"{where} pass_through"))
    fused = []
    for i, entry in enumerate(section.get("fused") or []):
        at = f"{source}: [[ops.fused]] entry {i + 1}"
        _check_keys(entry, "ops.fused", at)
        if not isinstance(entry, dict) or not isinstance(entry.get("op"), str) or "ends" not in entry:
            raise LayerdiffError(f"{at}: needs 'op' (the fused kind) and 'ends' (kinds its sequence ends with)")
        longest = entry.get("longest", 16)
        if not isinstance(longest, int) or isinstance(longest, bool) or not 1 < longest <= 64:
            raise LayerdiffError(f"{at}: 'longest' is the longest sequence, 2 to 64")
        fused.append(FusedOpRule(canonical_of(entry["op"]),
                                 tuple(canonical_of(k) for k in _strings(entry["ends"], at + " ends")), longest,
                                 source, tuple(canonical_of(k) for k in _strings(entry.get("holds") or [],
                                                                                 at + " holds"))))
    arguments = section.get("arguments") or {}
    if not isinstance(arguments, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in arguments.items()):
        raise LayerdiffError(f"{where} arguments: a table of argument name = canonical name (axis = \"dim\")")
    return kinds, pass_through, tuple(fused), dict(arguments)


def load_file(path) -> RuleSet:
    """A user's rule file (TOML, the schema of ``from_dict``)."""
    path = Path(path)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python < 3.11
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise LayerdiffError(f"{path}: no such rule file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LayerdiffError(f"{path}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise LayerdiffError(f"{path}: not valid TOML ({exc})") from None
    return from_dict(data, str(path))


@functools.lru_cache(maxsize=1)
def builtin() -> RuleSet:
    """Every built-in rule set, merged (they only act where their module names appear); made once (immutable)."""
    from layerdiff.match.rulesets import ALL

    merged = RuleSet()
    for name, data, listed in ALL:
        merged = merged.merged(from_dict(data, f"built-in:{name}", listed=listed))
    return merged


def ruleset(files=()) -> RuleSet:
    """The built-in rules plus the user's files (which take precedence)."""
    merged = builtin()
    for path in files or ():
        merged = merged.merged(load_file(path))
    return merged
