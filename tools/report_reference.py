"""Write docs/reference/report.md, the JSON report reference, from the report's declarations in layerdiff/schema.py.

    python tools/report_reference.py           # (re)write the page
    python tools/report_reference.py --check   # exit 1 if the page differs from what the declarations give

The page has one section per object: ``schema.Report`` and every ``TypedDict`` reachable from it, in the order
they are first reached. Each key's type and whether it is required come from the declarations
(``typing.get_type_hints``, ``__required_keys__``); an object's description is its docstring; a key's description
is the entry in ``KEYS`` below, else the inline comment next to its declaration. The trace records
(``TraceRecord`` and what it holds) are not part of the report and are documented in docs/trace-format.md.
"""
from __future__ import annotations

import argparse
import difflib
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal, Union

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from layerdiff import schema  # noqa: E402

PAGE = ROOT / "docs" / "reference" / "report.md"

# What an object says about itself where its declaration has no docstring
OBJECTS = {
    "Failure": "Where a traced run raised: the module, the error, and the modules active then.",
    "Tolerance": "The tolerance a tensor pair was judged by: it passes when "
                 "`max_abs <= atol + rtol * ref_max_abs` and `cosine >= cos` (the cosine is not judged when "
                 "`ref_max_abs <= atol`: both tensors are within the absolute tolerance of zero).",
    "NonfiniteOrigin": "The first call of a run whose inputs are finite and whose outputs (or input gradients) are not.",
    "ModuleMatch": "One inferred module match and its evidence.",
    "Unmatched": "Modules of each run with no counterpart in the other.",
    "PhaseResult": "One direction of the alignment, forward or backward: its verdict and its origin.",
    "Trust": "Why an `aligned` verdict may not be trusted; the CLI exits 3 when `ok` is false and the verdict is "
             "aligned.",
}

# Key descriptions, by object. An entry for a key the declarations no longer have is an error (the page would lie).
KEYS = {
    "Report": {
        "report_version": "The report format's version. Keys are only ever added; a renamed or retyped key bumps "
                          "it.",
        "a": "Run A, the reference.",
        "b": "Run B, the candidate.",
        "records": "Every matched record, with every tensor's metrics, tolerance and judgement.",
        "only_a": "Records of run A with no counterpart in B.",
        "only_b": "Records of run B with no counterpart in A.",
        "first_nonfinite": "Where each run first produced NaN or Inf.",
        "basis": "What the comparison read: `data` (tensor values), `stats` (statistics only), `mixed` or `none`.",
        "structure": "`same_model` (one model class: a tensor given to one run only counts, made or dropped) or "
                     "`ported` (only a tensor the caller got in both runs and handed on in one counts).",
        "phases": "Per phase (`forward`, `backward`): whether each run (`a`, `b`) recorded it.",
        "same_file": "A and B are the same file (the verdict is then not trusted).",
        "map": "The `--map` rules used, as `[pattern, replacement]`, and the exact renames matching found.",
        "layouts": "The `--layout` rules used, as `[regex, transform]`.",
        "rules": "Where the rules used came from (built-in rule sets, `--rules` files).",
        "mapping": "The inferred matches of modules whose names differ, each with its evidence.",
        "unmatched_modules": "Modules of each run with no counterpart in the other.",
        "settings": "Run settings that break parity: `{\"differ\": [{\"key\", \"a\", \"b\", \"why\"}], \"notes\": "
                    "{\"a\", \"b\"}}`; `notes` are the runs' own notes (`meta={...}`, the target and its `--arg`s).",
        "config_diff": "The models' own configurations where they differ, in canonical keys "
                       "(`[{\"key\", \"a\", \"b\", \"name_a\", \"name_b\", ...}]`); null when a trace holds no config.",
        "not_compared": "Tensor pairs whose comparison did not complete (tasks that failed on a Dask cluster after "
                        "their retries, `--scheduler`): each is also in its row's `skipped`, and `trust` names them; "
                        "empty when everything was compared.",
        "recompute": "Per run (`a`, `b`): its calls that activation checkpointing recomputed in backward, each "
                     "against the forward call it replays; null for a run that recomputed nothing.",
        "forward": "The forward direction: verdict and origin.",
        "backward": "The backward direction: verdict and origin.",
        "verdict": "`aligned` or `divergent`.",
        "trust": "Why an `aligned` verdict may not be trusted (exit 3).",
        "next_pass": "After an align on statistics: the suspect block to trace again in full mode, "
                     "`{\"block\", \"layers\", \"container\"}` (`layers` is the `--layers START:END` value); null "
                     "otherwise.",
        "tolerances": "The tolerance policy the report was judged under: the per-dtype defaults, the "
                      "`--atol/--rtol/--cos` override and the `--tol` rules.",
        "params": "Parameters: `compared`, `differ` (names whose values differ), `grads_compared`, `grads_differ`, "
                  "`grad_uses_differ` (users of a tied weight whose own gradient contribution differs).",
        "growth": "How the error grows (the block table): forward calls at the depth that shows the model's "
                  "blocks, plus the origin's ancestors and siblings; each `{\"module\", \"call\", \"type\", "
                  "\"depth\", \"passed\", \"max_abs\", \"rel\", \"cosine\", \"origin\"}`, and `\"nonfinite\"`: "
                  "how many elements are NaN or infinite in one run and not in the other, in the output ranked "
                  "worst (its other metrics are over the finite values; the terminal shows `NaN/Inf xN`).",
    },
    "RunSummary": {
        "path": "The trace file, or the directory of a multi-rank run.",
        "framework": "From the trace's metadata.",
        "framework_version": "From the trace's metadata.",
        "model_class": "From the trace's metadata.",
        "mode": "`full` or `stats`.",
        "records": "How many records the trace holds.",
        "complete": "False when the run did not finish: only what it recorded before was compared.",
        "status": "`complete`, `error` (the traced run raised) or `interrupted` (the trace has no end record).",
        "failure": "Where the traced run raised; null if it did not.",
        "warnings": "The trace's warnings.",
        "target": "The `layerdiff trace` TARGET.",
        "target_args": "The TARGET's `--arg`s.",
        "param_dtypes": "From the trace's metadata.",
        "autocast_dtypes": "The dtypes automatic mixed precision (torch.autocast) computed in during the run; empty "
                           "when it was off. Where either run has any, every floating tensor is judged at the least "
                           "precise of them and the parameters' dtypes.",
        "devices": "From the trace's metadata.",
        "damage": "What was written whole and no longer reads as written: index lines (where, what they read as, "
                  "why; skipped, the records after them read), the metadata, and tensors whose bytes do not match "
                  "their checksums (compared by their statistics instead). Any of it makes the verdict untrusted.",
        "unverified": "Records without a checksum: a trace written before checksums, read as before but not "
                      "verified.",
    },
    "Failure": {
        "module": "The innermost module active when the run raised.",
        "call": "That module's call index.",
        "error": "The exception, as one line.",
        "module_stack": "The modules active when it was raised, outermost first.",
    },
    "Row": {
        "kind": "`call`, `param`, `param_grad` or `param_grad_use`, as in the trace; `op` for an operation inside "
                "a module call (`--ops`): its `path` and `call` are its module call's, `op`/`op_b` say which.",
        "phase": "`forward` or `backward` for a call; null for a parameter.",
        "path": "A's module path (a parameter's name for a parameter row).",
        "call": "The call index: a module called twice gives two rows.",
        "step": "The step, 0-based.",
        "begin": "A's event counter when the call began (execution order).",
        "end": "A's event counter when the call ended.",
        "parent": "`[path, call]` of the enclosing call in A.",
        "tensors": "Every paired tensor, measured and judged.",
        "path_b": "B's module: `\"X + Y\"` when A's module is several of B's.",
        "type_a": "The module's class in A.",
        "type_b": "The module's class in B.",
        "family_a": "The type family of A's class (`Linear`, `Dense` and `ColumnParallelLinear` are one).",
        "family_b": "The type family of B's class.",
        "ancestors": "A's enclosing calls, innermost first.",
        "module": "A parameter row's module.",
        "hparams_a": "The call's scalar hyper-parameters in A.",
        "hparams_b": "The call's scalar hyper-parameters in B.",
        "error_a": "What the call raised in A.",
        "error_b": "What the call raised in B.",
        "only_a": "A's tensors of this record without a partner in B (`role:key`).",
        "only_b": "B's tensors of this record without a partner in A.",
        "tied": "The owners of a tied parameter.",
        "skipped": "Tensor pairs that were not compared, and why.",
        "op": "An `op` row: A's operation.",
        "op_b": "An `op` row: B's counterpart.",
        "ops": "A module call whose operations both runs recorded: how many, and those without a counterpart.",
        "inputs_inside": "B's module that computes this call's inputs inside itself and never records them (a "
                         "Linear applying the activation this row is): they are not compared; where this call "
                         "diverges and the call that made them in A has parameters that differ, the origin is that "
                         "call.",
        "dropped": "Of the inputs given to one run only (`only_a`/`only_b`), those the caller got in both runs and "
                   "handed on in one: between a model and its port, only these count as a difference of the "
                   "inputs.",
    },
    "TensorResult": {
        "role": "`input`, `output`, `grad_output`, `grad_input`, `param` or `param_grad`.",
        "key": "A's key: `args.0`, `kwargs.attention_mask`, `out.logits`, ...",
        "dtype_a": "A's dtype.",
        "dtype_b": "B's dtype.",
        "metrics": "How the pair differs.",
        "shape_a": "A's shape.",
        "shape_b": "B's shape.",
        "key_b": "B's key, where it differs.",
        "nonfinite_a": "NaN and Inf values in A's tensor.",
        "nonfinite_b": "NaN and Inf values in B's tensor.",
        "value_a": "A one-element tensor (the loss): its value in A; align prints it step by step.",
        "value_b": "Its value in B.",
        "passed": "Within tolerance.",
        "reason": "Why it passed or failed, in words.",
        "tolerance": "The tolerance it was judged by.",
        "ranks": "Multi-rank runs: the ranks whose shard or copy is off.",
        "hint": "A likely cause: the ranks' copies differ but add up to the reference's (a missing all-reduce), or an "
                "integer or boolean tensor made by a choice (top-k, argmax) differs (near-ties under rounding).",
        "one_sided": "An input given to one run only; it fails.",
        "inherited": "Against a run in another precision: over its tolerance, but judged agreeing, its error no more "
                     "than 4x the largest among what it was computed from ([Inherited](#inherited)).",
        "accumulated": "Against a run in another precision: the model's own output, over its tolerance (it fails), "
                       "with no more error than 4x the largest among what it was computed from: rounding grown "
                       "through the model ([Inherited](#inherited)).",
    },
    "Metrics": {
        "basis": "`data` (values), `stats` (statistics only), `shape` (not comparable) or `declared`.",
        "identical": "Bit-identical.",
        "max_abs": "Max abs difference.",
        "mean_abs": "Mean abs difference.",
        "max_rel": "Max relative difference.",
        "cosine": "Cosine similarity (null when computed from statistics).",
        "rel_l2": "Values compared: `|A - B| / |A|` (L2 norms), the error's size relative to the reference's, "
                  "whether it turns the tensor or scales it.",
        "ref_max_abs": "The reference's largest magnitude, which scales `rtol`.",
        "numel": "Elements compared.",
        "mismatch": "Why the pair could not be compared (shape, dtype, one side absent).",
        "nonfinite_mismatch": "NaN/Inf values that differ between the runs.",
        "note": "How the pair was compared: transposed, a part of a fused tensor, reordered dimensions, cos of "
                "rotary angles.",
        "matched_by": "How the pair was made when not by name (position and shape, with B's key).",
        "ranks": "Per-rank metrics (`\"0\"`, `\"1\"`, ...) and `\"sum\"` of a tensor spread over ranks.",
        "damaged": "One side's stored bytes do not match their checksum (which side, where): the pair is compared by "
                   "the statistics of its index lines, which are verified, instead.",
    },
    "Tolerance": {
        "atol": "Absolute tolerance.",
        "rtol": "Tolerance relative to `ref_max_abs`.",
        "cos": "Minimum cosine similarity.",
    },
    "ShortRecord": {
        "path": "Its module path.",
        "kind": "`call`, `param`, `param_grad` or `param_grad_use`.",
        "phase": "`forward` or `backward` (null for a parameter's record).",
        "call": "Its call index (a parameter's: the how-manieth record of it).",
    },
    "FirstNonfinite": {
        "a": "Run A's first NaN/Inf; null if it has none.",
        "b": "Run B's first NaN/Inf; null if it has none.",
    },
    "NonfiniteOrigin": {
        "module": "The call's module path.",
        "phase": "`forward` or `backward`.",
        "tensor": "The tensor's key.",
        "nan": "How many NaN values it holds.",
        "inf": "How many Inf values it holds.",
        "call": "The call's index.",
    },
    "ModuleMatch": {
        "a": "A's module path.",
        "b": "B's module path.",
        "confidence": "From 0 to 1.",
        "reason": "The evidence: same weights, name tokens, type, sizes, position.",
        "rule": "The fused-module rule, for a fused module (`qkv`, `gate_up`, ...).",
        "a_parts": "Every path on A's side of a fused match.",
        "b_parts": "Every path on B's side of a fused match.",
        "inside": "B's module that runs `b` inside itself, after its own work (a Linear that applies its "
                  "activation as a child): found from structure and values, whatever the child's class.",
    },
    "NotCompared": {
        "phase": "`forward` or `backward`; null for a parameter.",
        "path": "The record's path (A's name).",
        "call": "The record's call index.",
        "tensor": "`role:key` of the tensor pair.",
        "reason": "Why: the worker's error in one line (`FileNotFoundError: ...`), or that its worker died each time "
                  "(`KilledWorker`), and where (the cluster's address).",
    },
    "RecomputeCheck": {
        "calls": "Calls recomputed in backward in the run.",
        "compared": "Of those, the calls matched to the forward call they replay and compared with it.",
        "differ": "The recomputed calls whose outputs are not the forward's (bit for bit where values are stored, "
                  "else by statistics), in the order they began.",
    },
    "RecomputedCall": {
        "path": "The module's path.",
        "call": "The call index (the forward call it replays).",
        "step": "The step.",
        "tensor": "`output:key` of its first output that differs.",
        "max_abs": "The largest difference (by statistics: among min, max, mean and RMS).",
        "basis": "`data` (stored values), `stats`, or `shape` (not even the shapes agree).",
        "inputs_agree": "Its inputs were the forward's: the recomputation departs here (the calls that follow "
                        "differ because what they were given does).",
        "rank": "In a run of ranks: the rank whose file recomputed it.",
    },
    "Unmatched": {
        "a": "Modules of A with no counterpart in B.",
        "b": "Modules of B with no counterpart in A.",
    },
    "OriginTensor": {
        "role": "Its role.",
        "key": "Its key.",
        "reason": "Why it failed.",
        "metrics": "Its metrics.",
    },
    "Origin": {
        "module": "The origin's module path as named in trace A.",
        "call": "Its call index.",
        "step": "The step, 0-based (the text says \"at step 2 of 3\", 1-based).",
        "type": "A's module class.",
        "where": "`module` (the module's own computation), `own_code` (a parent's own code between two children), "
                 "`inputs` (the runs were given different inputs), `forward` (backward inherited from the forward "
                 "divergence), `raised`, `param_grad` (parameter gradients differ though no call shows it), `update` "
                 "(the parameters a step begins with differ while every earlier step agrees: the update between "
                 "the steps, such as the optimizer's; `module` is then the first such parameter's); with "
                 "operations recorded (`--ops`), `op` (an operation of `module`'s own code: its inputs agree, its "
                 "output does not) and `op_input` (the code passed an operation a tensor that differs while what "
                 "made it agrees).",
        "between": "For `own_code`: the children before and after the divergence.",
        "description": "The origin in words, as the terminal prints it.",
        "tensor": "The first failing tensor, with its metrics.",
        "ranks": "Multi-rank runs: the ranks whose shard or copy is off.",
        "hint": "A likely cause (a missing all-reduce; a choice such as top-k flipped by near-ties).",
        "hparam_diff": "Hyper-parameters that differ: name to `[A, B]` (`epsilon`/`variance_epsilon` count as "
                       "`eps`), and `type` when the module type changed.",
        "param_diffs": "The origin's own parameters whose values (backward: gradients) differ.",
        "error": "What the origin raised.",
        "class_diff": "`[A's class, B's class]` when the class changed within its type family.",
        "chain": "The calls from the root to the origin.",
        "phase": "`forward` or `backward`.",
        "path_b": "B's module.",
        "unpaired": "The origin's tensors without a partner, per run (`a`, `b`).",
        "backward_candidate": "An inherited backward origin: what the backward descent alone would name, to check "
                              "after the forward fix.",
        "op": "With operations recorded (`--ops`): the operation, inside `module`'s own code, where the divergence "
              "starts: its name, kind, index, source line and function in each run, the non-tensor arguments "
              "that differ and the metrics of its first failing tensor.",
    },
    "OriginOp": {
        "name": "A's operation as the code called it (`torch.matmul`, `Tensor.mul`).",
        "kind": "Its framework-neutral kind (`matmul`, `mul`).",
        "index": "Its index among the operations of its module call.",
        "source": "`FILE:LINE` of the model code that called it, in A.",
        "function": "The function that line is in.",
        "args_diff": "Its non-tensor arguments the runs set differently: name to `[A, B]`.",
        "metrics": "The metrics of its first failing tensor.",
        "name_b": "B's counterpart's name.",
        "index_b": "B's counterpart's index.",
        "source_b": "`FILE:LINE` of B's call.",
        "function_b": "The function it is in, in B.",
        "wrong_input": "The operation's input differs while whatever made that input agrees: the code passed it "
                       "another tensor (the origin's `where` is `op_input`).",
        "unknown_maker": "With `wrong_input`: that input was made where nothing was recorded (before the traced "
                         "call, or outside model code), so nothing says that what made it agrees; present only when "
                         "true.",
        "dtype_diff": "`[A's dtype, B's dtype]` of its output, when the operation changed the precision (the "
                      "operations after it agree only under the lower precision's tolerance).",
        "only_a": "`op_input`: A's operations without a counterpart in B, run before this one in the same call, "
                  "when what made the differing input is one of them (`[index, name, source]`).",
        "only_b": "`op_input`: B's operations without a counterpart in A that make the differing input: code "
                  "one run has and the other does not.",
    },
    "OpInfo": {
        "index": "Its index among the operations of its module call.",
        "name": "As the code called it (`torch.matmul`, `Tensor.mul`, `torch.nn.functional.softmax`).",
        "kind": "Framework-neutral (`matmul`, `mul`, `softmax`).",
        "source": "`FILE:LINE` of the model code that called it.",
        "function": "The function that line is in.",
        "args": "Its non-tensor arguments (scalars, dtypes, dims), by position (`args.1`) or name (`kwargs.dim`).",
        "producers": "Where each tensor input came from, by key.",
        "in_place": "It modified its first argument in place.",
    },
    "OpsSummary": {
        "a": "Operations run A recorded in this call.",
        "b": "Operations run B recorded in the counterpart call.",
        "only_a": "A's operations with no counterpart, `[index, name, source]`.",
        "only_b": "B's, the same.",
    },
    "ProducerRef": {
        "kind": "`op` (an earlier operation of the call), `input` (the call's own input), `call` (a child module "
                "call's output), `param`, `buffer`, `outer` (a tensor of an enclosing call reached without being "
                "passed in) or `unknown`.",
        "index": "`op`: the operation's index.",
        "key": "`op`, `call`: the output's key; `input`: the input's key.",
        "path": "`call`, `outer`: the module path.",
        "call": "`call`, `outer`: the call index.",
        "name": "`param`, `buffer`: its name.",
    },
    "Inherited": {
        "growth": "Its relative error (`rel_l2`) over the largest among its inputs, its parameters and "
                  "what its children computed.",
        "over": "How it was over its tolerance (the reason it would have failed).",
    },
    "PhaseResult": {
        "present": "The direction was recorded.",
        "status": "`aligned`, `divergent`, `failed` (a run raised) or `absent`.",
        "failing_tensors": "How many tensors are over tolerance.",
        "inherited_tensors": "Against a run in another precision: how many tensors over their tolerance were judged "
                             "agreeing, their error inherited from what they were computed from (not counted in "
                             "`failing_tensors`).",
        "first_divergence": "The origin; null when the direction is aligned.",
        "first_over_tolerance": "`{\"module\", \"call\"}` of the first call, in completion order, with a tensor over "
                                "tolerance: often downstream of the origin.",
        "failure": "Forward: where run B raised, `{\"module\", \"error\", \"module_stack\"}`; null if it did not.",
        "failure_a": "Forward: the same for run A.",
    },
    "Trust": {
        "ok": "Nothing undermines the verdict.",
        "problems": "What does: a damaged trace (its damaged parts named), a run that did not finish, a direction "
                    "recorded on one side only, the same file twice.",
        "notes": "What was not checked and does not make the verdict wrong: a trace written before checksums "
                 "(format 2 or older) cannot be verified.",
    },
}

LEAVES = {
    schema.Int64: "integer",
    schema.Count: "integer >= 0",
    schema.Number: "number",
    schema.CallRef: "`[path, call]`",
    schema.ParentRef: "`[path, call]` or `[]`",
    str: "string",
    bool: "boolean",
    dict: "object",
    list: "list",
    type(None): "null",
    Any: "any",
}
PLURALS = {"integer": "integers", "integer >= 0": "integers >= 0", "number": "numbers", "string": "strings",
           "boolean": "booleans", "object": "objects", "any": "values"}


def is_object(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def title(cls) -> str:
    """The object's name on the page: ``_RunSummaryKeys`` is ``RunSummary``."""
    name = cls.__name__.lstrip("_")
    return name[:-4] if name.endswith("Keys") else name


def in_words(tp) -> str:
    """A declared type in words; an object is a link to its section."""
    if tp in LEAVES:
        return LEAVES[tp]
    if is_object(tp):
        return f"[{title(tp)}](#{title(tp).lower()})"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        words = [in_words(a) for a in args if a is not type(None)]
        return " or ".join(words + ["null"] * (type(None) in args))
    if origin is Literal:
        return " or ".join(f"`{json.dumps(a)}`" for a in args)
    if origin is list:
        item = in_words(args[0])
        return "list of " + PLURALS.get(item, f"({item})" if " or " in item else item)
    if origin is dict:
        value = in_words(args[1])
        if args[1] is Any:
            return "object"
        return f"object of {PLURALS[value]}" if value in PLURALS else f"object (each value a {value})"
    raise SystemExit(f"report_reference: no words for the type {tp!r}: add it to LEAVES")


def reachable(root) -> list:
    """``root`` and every object declaration reachable from it, in the order first reached (breadth first)."""
    def objects_in(tp):
        if is_object(tp):
            yield tp
        for arg in typing.get_args(tp):
            yield from objects_in(arg)

    found, queue = [root], [root]
    while queue:
        for hint in typing.get_type_hints(queue.pop(0), include_extras=True).values():
            for cls in objects_in(hint):
                if cls not in found:
                    found.append(cls)
                    queue.append(cls)
    return found


def comments(cls) -> dict:
    """The inline comments of the keys a declaration and its bases declare: ``key: type  # comment``."""
    out = {}
    for base in reversed(cls.__mro__):
        if is_object(base) and base.__module__ == schema.__name__:
            for line in inspect.getsource(base).splitlines():
                found = re.match(r"\s+(\w+): [^#]*#\s*(.+)$", line)
                if found:
                    out[found.group(1)] = found.group(2).strip().rstrip(".") + "."
    return out


def prose(text: str) -> str:
    """A docstring as one Markdown paragraph."""
    return " ".join(text.replace("``", "`").split())


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def section(cls) -> list:
    name, hints = title(cls), typing.get_type_hints(cls, include_extras=True)
    described = KEYS.get(name, {})
    stale = sorted(set(described) - set(hints))
    if stale:
        raise SystemExit(f"report_reference: KEYS[{name!r}] describes keys {name} does not declare: {stale}")
    noted = comments(cls)
    about = prose(cls.__doc__) if cls.__doc__ else OBJECTS.get(name, "")
    lines = [f"## {name}", ""] + ([about, ""] if about else [])
    lines += ["| key | type | presence | description |", "|---|---|---|---|"]
    for key, hint in hints.items():
        need = "required" if key in cls.__required_keys__ else "optional"
        text = described.get(key) or noted.get(key, "")
        lines.append(f"| `{key}` | {cell(in_words(hint))} | {need} | {cell(text)} |")
    return lines + [""]


def page() -> str:
    objects = reachable(schema.Report)
    unknown = sorted((set(KEYS) | set(OBJECTS)) - {title(c) for c in objects})
    if unknown:
        raise SystemExit(f"report_reference: descriptions of objects the report no longer holds: {unknown}")
    lines = [
        "# JSON report reference",
        "",
        "<!-- Generated by tools/report_reference.py from layerdiff/schema.py: do not edit by hand. -->",
        "",
        "The report `layerdiff align --json FILE` writes (`report.data` in Python, `report.to_json(path)` to write "
        "it), and `layerdiff report` reads back. Its shape is declared in `layerdiff/schema.py` and this page is "
        "generated from those declarations (`python tools/report_reference.py`; the test suite checks it is up to "
        "date).",
        "",
        f"- `report_version` is {schema.REPORT_VERSION}. Keys are only ever added; a renamed or retyped key bumps it. "
        "Keys not declared here may appear (a newer layerdiff may add some); a declared key always has its type.",
        "- Non-finite numbers are written as the strings `\"inf\"`, `\"-inf\"`, `\"nan\"`, so the file is standard "
        "JSON.",
        "- A report read back from a file is checked against these declarations: "
        "`schema.problem(value, schema.Report)` names the first place that does not fit, e.g. "
        "`records[3].tensors[0].metrics.max_abs is not a number or null`.",
        "- *required* keys are always present; *optional* ones may be missing.",
        "",
        "Objects: " + ", ".join(f"[{title(c)}](#{title(c).lower()})" for c in objects) + ".",
        "",
    ]
    for cls in objects:
        lines += section(cls)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not what the declarations give")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       str(PAGE.relative_to(ROOT)), "generated"))
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python tools/report_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
