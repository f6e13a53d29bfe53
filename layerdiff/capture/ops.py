"""Operations inside module calls (``ops`` tracing), the framework-neutral half: which calls record the operations
their own code runs, where each tensor that code holds came from (producers, by tensor identity), which line of
model code made a call, and what one operation records forward and backward.

A framework's interceptor (``adapters/torch_ops.py``) sees every framework function, tensor method and operator,
and hands each one to ``OpCapture.run``; everything else is here, so that every framework records operations the
same way (``docs/concepts/operations.md``)."""
from __future__ import annotations

import contextlib
import os
import re
import site
import sysconfig
import weakref
from dataclasses import dataclass, field
from types import CodeType, FrameType
from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Iterable, Sequence

from layerdiff.capture.structure import replace_tensors, walk

# the layerdiff package; its recipes (model code shipped as examples) are not layerdiff's own code
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_RECIPES = "recipes" + os.sep


@dataclass(frozen=True)
class OpName:
    """How model code called an operation: ``name`` as written (``torch.matmul``, ``Tensor.mul``), ``kind`` the
    framework-neutral operation (``matmul``, ``mul``), ``in_place`` whether it modifies its first argument."""

    name: str
    kind: str
    in_place: bool = False


_OPERATOR_KINDS = {"truediv": "div", "true_divide": "div", "floordiv": "floor_divide", "rsub": "sub",
                   "radd": "add", "rmul": "mul", "rtruediv": "div", "rdiv": "div", "rpow": "pow", "rmatmul": "matmul",
                   "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "div", "idiv": "div", "ipow": "pow",
                   "and": "logical_and", "or": "logical_or", "invert": "logical_not", "lt": "lt", "gt": "gt"}
_IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ipow__", "__setitem__",
                       "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


def kind_of(short: str) -> tuple[str, bool]:
    """The framework-neutral kind of a function, method or operator by its short name (``__mul__``, ``mul_``,
    ``true_divide``: ``mul``, ``mul``, ``div``), and whether it modifies its first argument in place (a trailing
    underscore, an augmented assignment)."""
    in_place = short in _IN_PLACE_OPERATORS or (short.endswith("_") and not short.endswith("__")
                                                and not short.startswith("_"))
    kind = short.strip("_")
    if in_place and not short.startswith("__"):
        kind = short[:-1]
    return _OPERATOR_KINDS.get(kind, kind), in_place


@dataclass
class OpFrame:
    """One operation in flight: its place (the ``index``-th of its module call ``frame``), what it was called
    with, and, in backward, the gradients w.r.t. its outputs until those w.r.t. its inputs arrive."""

    frame: Any  # the session's CallFrame of the module call whose own code runs the operation
    index: int
    name: OpName
    begin: int
    inputs: list[dict]
    args: dict[str, Any]
    producers: dict[str, dict]
    source: str | None
    function: str | None
    grad_outputs: list[dict] | None = None
    backward_begin: int = 0


class SourceFinder:
    """The line of model code that made a call: the first frame, walking out from the interceptor, that belongs
    neither to the framework (``framework_dirs``), nor to Python's standard library, nor to layerdiff itself.
    Model code is everything else: transformers, Megatron, PaddleFormers, mindformers and the user's files. A call
    made on the way through the framework's machinery around the model (``machinery_dirs``: FSDP gathering a
    layer's weights in its forward hook) is, like one of layerdiff's own, none of the model's."""

    def __init__(self, framework_dirs: Iterable[str], machinery_dirs: Iterable[str] = ()):
        paths = sysconfig.get_paths()
        # every site-packages: a venv made with --system-site-packages imports from the base Python's too, which
        # sits under the base's stdlib directory (PaddleFormers there was skipped as standard library)
        sites = [paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", list)()]
        self.site = tuple(dict.fromkeys(os.path.abspath(p) + os.sep for p in sites))
        self.stdlib = tuple(os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib"))
        self.framework = tuple(os.path.abspath(d) + os.sep for d in framework_dirs)
        self.machinery = tuple(os.path.abspath(d) + os.sep for d in machinery_dirs)
        # code object -> "skip" (framework, stdlib), "own" (layerdiff; the framework's machinery), "model"
        self.verdicts: dict[CodeType, str] = {}

    def _verdict(self, code: CodeType) -> str:
        verdict = self.verdicts.get(code)
        if verdict is None:
            path = code.co_filename
            if path.startswith("<") and not path.startswith("<ipython"):
                verdict = "skip"  # frozen importlib, string-compiled framework glue
            else:
                path = os.path.abspath(path)
                if self.machinery and path.startswith(self.machinery):
                    verdict = "own"  # the framework's machinery around the model: not the model's operations
                elif path.startswith(self.framework):
                    verdict = "skip"
                elif path.startswith(_OWN_DIR) and not path[len(_OWN_DIR):].startswith(_RECIPES):
                    verdict = "own"
                elif path.startswith(self.stdlib) and not path.startswith(self.site):
                    verdict = "skip"
                else:
                    verdict = "model"
            self.verdicts[code] = verdict
        return verdict

    def locate(self, frame: FrameType | None) -> tuple[str, str] | None:
        """("FILE:LINE", function) of the first frame of model code from ``frame`` outwards; None when the call
        came from layerdiff itself (its hooks compute statistics with framework functions too)."""
        while frame is not None:
            verdict = self._verdict(frame.f_code)
            if verdict == "model":
                code = frame.f_code
                return f"{code.co_filename}:{frame.f_lineno}", getattr(code, "co_qualname", code.co_name)
            if verdict == "own":
                return None
            frame = frame.f_back
        return None


class Producers:
    """Where each tensor that a module call's own code holds came from, by identity: registered when the call
    receives it (an input), when one of its operations makes it, or when a child call returns it; parameters and
    buffers are known by the model. A tensor is looked up in the call that uses it, then in the calls around it
    (``outer``: it was reached without being passed in)."""

    def __init__(self, params: dict[int, str], buffers: dict[int, str]):
        self.params = params  # id(parameter) -> name
        self.buffers = buffers
        self.by_frame: dict[int, dict[int, tuple[weakref.ref, dict]]] = {}

    def register(self, frame: Any, tensor: Any, producer: dict) -> None:
        try:
            ref = weakref.ref(tensor)
        except TypeError:  # a tensor type that takes no weak reference: its identity cannot be trusted later
            return
        self.by_frame.setdefault(id(frame), {})[id(tensor)] = (ref, producer)

    def _in(self, frame: Any, tensor: Any) -> dict | None:
        found = self.by_frame.get(id(frame), {}).get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found[1]
        return None

    def lookup(self, frame: Any, tensor: Any, stack: Sequence[Any]) -> dict:
        """The producer of ``tensor`` as call ``frame`` sees it (``stack``: the calls in progress, outermost
        first)."""
        found = self._in(frame, tensor)
        if found is not None:
            return found
        name = self.params.get(id(tensor))
        if name is not None:
            return {"kind": "param", "name": name}
        name = self.buffers.get(id(tensor))
        if name is not None:
            return {"kind": "buffer", "name": name}
        for outer in reversed(stack):
            if outer is not frame and self._in(outer, tensor) is not None:
                return {"kind": "outer", "path": outer.path, "call": outer.call}
        return {"kind": "unknown"}

    def drop(self, frame: Any) -> None:
        """The call ended: what its code held is gone with it."""
        self.by_frame.pop(id(frame), None)

    def clear(self) -> None:
        self.by_frame.clear()


class Unwritten:
    """The tensors allocated and not yet written, and views of them, by identity: each stays no evidence (its entries
    say ``undefined``) until an in-place operation writes that tensor itself. A write through one of its views
    (``key_states[..., :n].copy_(k)`` into a ``new_empty``) leaves the rest of it as the memory held."""

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref] = {}

    def __contains__(self, tensor: Any) -> bool:
        ref = self.refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def add(self, tensor: Any) -> None:
        try:
            self.refs[id(tensor)] = weakref.ref(tensor)
        except TypeError:  # no weak reference: its identity cannot be trusted later
            return
        if len(self.refs) > 1024:
            self.refs = {k: ref for k, ref in self.refs.items() if ref() is not None}

    def discard(self, tensor: Any) -> None:
        if tensor in self:
            del self.refs[id(tensor)]


@dataclass
class OpGradients:
    """The framework's part of an operation's backward. ``one_step(inputs, outputs, callback)``: where the
    operation is one step of the framework's autograd graph, hook that step and return True; it calls back
    ``callback(grad_inputs, grad_outputs)`` ([(key, gradient)] each) once, when the step has run (None: the
    framework hooks no step of its graph, as in Paddle and MindSpore: every operation is tapped). Otherwise
    ``alias`` routes each input through an identity (its gradient there is this operation's own contribution)
    and ``on_gradients(tensors, callback)`` calls back once with the gradients w.r.t. all of ``tensors``."""

    differentiable: Callable[[Any], bool]
    alias: Callable[[Any], Any]
    on_gradients: Callable[[list, Callable[[list], None]], None]
    enabled: Callable[[], bool]
    one_step: Callable[[list, list, Callable[[list, list], None]], bool] | None = None  # None: no such hook


# operations that only lay their one input out anew: their output holds the same values (statistics taken over)
SAME_VALUES = frozenset({"view", "reshape", "view_as", "reshape_as", "transpose", "permute", "t", "T", "mT",
                         "contiguous", "clone", "detach", "flatten", "unflatten", "squeeze", "unsqueeze", "data",
                         "alias", "to", "movedim", "swapaxes", "swapdims"})


# operations that allocate their output without writing it (``torch.empty_like``): its bytes are whatever the memory
# held, so their values (and statistics: possibly NaN) are no evidence, until an operation writes them
UNDEFINED_VALUES = frozenset({"empty", "empty_like", "new_empty", "empty_strided"})

# operations whose output holds some of their first input's values as they are (a view, a slice, a copy): of a tensor
# allocated and not yet written, that output is no evidence either (``key_states[..., :n]`` of a ``new_empty``,
# before ``copy_`` fills it through that slice)
LAYOUTS = SAME_VALUES | {"getitem", "select", "narrow", "slice", "split", "split_with_sizes", "tensor_split",
                         "chunk", "unbind", "expand", "expand_as", "diagonal", "as_strided", "unfold", "hsplit",
                         "vsplit", "view_as_real", "view_as_complex"}

# in-place operations that write every element of their first argument without reading it (an initializer, a fill, a
# copy into it): what that argument held before is no evidence (the memory ``torch.empty`` handed a new parameter)
OVERWRITES = frozenset({"uniform", "normal", "kaiming_uniform", "kaiming_normal", "xavier_uniform", "xavier_normal",
                        "trunc_normal", "orthogonal", "sparse", "constant", "ones", "zeros", "eye", "dirac", "zero",
                        "fill", "copy", "random", "exponential", "geometric", "cauchy", "log_normal", "bernoulli",
                        "set"})


@dataclass
class OpCapture:
    """Records the operations that the own code of selected module calls runs (see the module docstring).

    ``windows``: which module calls record their operations (``ops=True``: every one; patterns: the calls whose
    paths match, with ``include``'s semantics); a framework's own leaf modules (``nn.Linear``) never do. The
    interceptor asks ``recording()`` first (cheap), then hands the call to ``run``."""

    session: Any  # the TraceSession
    hooks: Any  # the ModuleHooks: ``busy`` while layerdiff's own hooks run
    is_tensor: Callable[[Any], bool]
    scalar: Callable[[Any], Any]  # a non-tensor argument as JSON (a dtype as "torch.float32"); None to leave out
    finder: SourceFinder
    producers: Producers
    gradients: OpGradients | None = None  # None: forward only (``backward=False``)
    depth: int = 0  # > 0 inside an operation: what it calls is part of it
    stats: dict[str, int] = field(default_factory=lambda: {"ops": 0})
    composite: set[OpName] = field(default_factory=set)  # found to be several autograd steps: tapped from then on
    unwritten: Unwritten = field(default_factory=lambda: Unwritten())
    # a context in which the interceptor works again where the framework turned it off around model code it runs
    # (activation checkpointing recomputing inside backward); set by the adapter's ``intercept_ops``
    resumed: Callable[[], ContextManager[Any]] = contextlib.nullcontext

    def recording(self) -> bool:
        """Whether an operation called now belongs to a module call that records its operations."""
        if self.depth or self.hooks.busy:
            return False
        stack = self.session.stack
        return bool(stack) and stack[-1].ops is not None

    def run(self, call: Callable[..., Any], name: OpName, args: tuple, kwargs: dict, caller: FrameType | None,
            *, several_steps: bool = False) -> Any:
        """Run one operation (``call(*args, **kwargs)``) and record it, if model code called it.
        ``several_steps``: it is more than one step of the autograd graph (a custom autograd function), so its
        inputs go through identity aliases for their gradients to be its own."""
        located = self.finder.locate(caller)
        if located is None:
            return call(*args, **kwargs)
        session, is_tensor = self.session, self.is_tensor
        frame = session.stack[-1]
        inputs: list[tuple[str, Any]] = []
        scalars: dict[str, Any] = {}
        _top_arguments(args, kwargs, is_tensor, self.scalar, inputs, scalars)
        stack = session.stack
        producers = {key: self.producers.lookup(frame, t, stack) for key, t in inputs}
        unwritten = self.unwritten
        undefined_in = {key for key, t in inputs if t in unwritten} if unwritten.refs else set()
        if name.in_place and inputs and name.kind in OVERWRITES:
            undefined_in.add(inputs[0][0])
        op = session.begin_op(frame, name, scalars, inputs, producers, *located, undefined_inputs=undefined_in)
        grads = self.gradients if self.gradients is not None and not name.in_place and \
            self.gradients.enabled() else None
        tapped: list[tuple[str, Any]] = []
        self.depth += 1  # from here on, framework calls (the taps' aliases too) are part of this operation
        try:
            if grads is not None and (several_steps or grads.one_step is None or name in self.composite):
                args, kwargs, tapped = self._tap_inputs(args, kwargs, inputs, grads)
            out = call(*args, **kwargs)
        except BaseException as exc:
            self.depth -= 1
            session.fail_op(op, exc)
            raise
        self.depth -= 1
        outputs: list[tuple[str, Any]] = []
        if name.in_place and inputs:
            outputs.append(("out", inputs[0][1]))
        elif is_tensor(out):  # most operations: one tensor
            outputs.append(("out", out))
        else:
            walk(out, "out", is_tensor, lambda k, t: outputs.append((k, t)), None)
        same = name.kind in SAME_VALUES
        if name.in_place and inputs:
            unwritten.discard(inputs[0][1])  # written itself (a write through one of its views is not enough)
        undefined = name.kind in UNDEFINED_VALUES or (
            not name.in_place and name.kind in LAYOUTS and bool(inputs) and inputs[0][0] in undefined_in)
        session.end_op(op, outputs, same_values=same, undefined=undefined)
        if undefined:
            for _, t in outputs:
                unwritten.add(t)
        self.stats["ops"] += 1
        for key, t in outputs:
            self.producers.register(frame, t, {"kind": "op", "index": op.index, "key": key})
        if grads is None or same or _hands_back(inputs, outputs):
            return out  # no gradients; a view or a copy (its gradient is its output's); an input handed back
        if tapped or grads.one_step is None:
            self._watch_gradients(op, tapped, outputs, grads)
        elif not grads.one_step(inputs, outputs, _OpGradients(session, op)):
            self.composite.add(name)  # its next calls are tapped; this one reports its output gradients only
            self._watch_gradients(op, [], outputs, grads)
        return out

    def _tap_inputs(self, args: tuple, kwargs: dict, inputs: list, grads: OpGradients) -> tuple[tuple, dict, list]:
        """Differentiable inputs swapped for identity aliases: their gradients are this operation's own."""
        swap: dict[int, Any] = {}
        tapped = []
        for key, t in inputs:
            if grads.differentiable(t):
                tapped.append((key, swap.setdefault(id(t), grads.alias(t))))
        if not swap:
            return args, kwargs, []
        return replace_tensors(args, self.is_tensor, swap), replace_tensors(kwargs, self.is_tensor, swap), tapped

    def _watch_gradients(self, op: OpFrame, tapped: list, outputs: list, grads: OpGradients) -> None:
        session = self.session
        wanted = [(k, t) for k, t in outputs if grads.differentiable(t)]
        if not wanted:
            return
        keys_out = [k for k, _ in wanted]
        keys_in = [k for k, _ in tapped]

        def on_outputs(gradients: list) -> None:
            session.op_grad_outputs(op, [(k, g) for k, g in zip(keys_out, gradients) if g is not None],
                                    waits=bool(keys_in))

        def on_inputs(gradients: list) -> None:
            session.op_grad_inputs(op, [(k, g) for k, g in zip(keys_in, gradients) if g is not None])

        grads.on_gradients([t for _, t in wanted], on_outputs)
        if tapped:
            grads.on_gradients([t for _, t in tapped], on_inputs)


class _OpGradients:
    """``one_step``'s callback: the operation's backward to its record. One object, not a closure and its cells (a
    step holds one per operation until its backward: fewer objects for the garbage collector to pass over)."""

    __slots__ = ("session", "op")

    def __init__(self, session: Any, op: OpFrame) -> None:
        self.session, self.op = session, op

    def __call__(self, grad_inputs: list, grad_outputs: list) -> None:
        self.session.op_grads(self.op, grad_outputs, grad_inputs)


def _hands_back(inputs: list, outputs: list) -> bool:
    """Whether an operation returned one of its inputs (``x.to(x.dtype)``, ``contiguous`` of a contiguous one)."""
    for _, t in outputs:
        for _, i in inputs:
            if t is i:
                return True
    return False


_ARG_KEYS = tuple(f"args.{i}" for i in range(16))
_PLAIN = (bool, int, float)


def _top_arguments(args: tuple, kwargs: dict, is_tensor: Callable[[Any], bool], scalar: Callable[[Any], Any],
                   tensors: list[tuple[str, Any]], out: dict[str, Any]) -> None:
    """``_arguments`` of a call's positional and keyword arguments, with the common ones (a tensor, a number,
    None) taken without a call each: the interceptor runs this for every operation."""
    if len(args) > 16:
        _arguments(args, "args", is_tensor, scalar, tensors, out)
        args = ()
    for key, v in zip(_ARG_KEYS, args):
        if is_tensor(v):
            tensors.append((key, v))
        elif v is None or type(v) in _PLAIN:
            out[key] = v
        else:
            _arguments(v, key, is_tensor, scalar, tensors, out)
    if kwargs:
        _arguments(kwargs, "kwargs", is_tensor, scalar, tensors, out)


def _arguments(obj: Any, prefix: str, is_tensor: Callable[[Any], bool], scalar: Callable[[Any], Any],
               tensors: list[tuple[str, Any]], out: dict[str, Any]) -> None:
    """The arguments of a call, flattened to dotted keys (as ``structure.walk`` names them): its tensors, and
    its non-tensor arguments: numbers, strings, None, and what the framework names (a dtype, a device); the
    elements of long containers and other objects are left out of the latter."""
    if is_tensor(obj):
        tensors.append((prefix, obj))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _arguments(v, f"{prefix}.{k}", is_tensor, scalar, tensors, out)
    elif isinstance(obj, (tuple, list)) and 0 < len(obj) <= 16 and \
            all(v is None or isinstance(v, (bool, int, float, str)) for v in obj):
        out[prefix] = list(obj)  # a shape, a list of dims: one argument (``dim=(-2, -1)``)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _arguments(v, f"{prefix}.{i}", is_tensor, scalar, tensors, out if len(obj) <= 16 else {})
    elif obj is None or isinstance(obj, (bool, int, float)):
        out[prefix] = obj
    elif isinstance(obj, str):
        if len(obj) <= 200:
            out[prefix] = obj
    else:
        value = scalar(obj)
        if value is not None:
            out[prefix] = value


class OpWindows:
    """Which module calls record their operations: every one (``ops=True``), or those whose path matches one of
    the patterns (``re.search``, as ``include`` matches: a module and everything inside it)."""

    def __init__(self, ops: bool | str | Sequence[str], paths: Sequence[str]):
        self.patterns: list[re.Pattern] = []
        if isinstance(ops, bool):
            if not ops:
                raise ValueError("ops=False records no operations: make no OpWindows")
            return
        for pattern in [ops] if isinstance(ops, str) else list(ops):
            try:
                self.patterns.append(re.compile(pattern))
            except (re.error, TypeError) as exc:
                raise ValueError(f"bad --ops-in regular expression {pattern!r}: {exc}") from None
        if not self.patterns:
            raise ValueError("ops: give True or at least one module-path pattern")
        named = [p for p in paths if p]
        if not any(self(p) for p in named):
            shown = " ".join(f"--ops-in {p.pattern!r}" for p in self.patterns)
            raise ValueError(f"{shown} matches none of the model's {len(named)} modules (e.g. "
                             f"{', '.join(named[:3])})")

    def __call__(self, path: str) -> bool:
        return not self.patterns or any(p.search(path) for p in self.patterns)
