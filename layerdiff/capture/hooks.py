"""The framework-independent half of an adapter's hooks: what a traced module call records, and when."""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable, ClassVar, ContextManager, Iterable

from mypy_extensions import mypyc_attr

from layerdiff.capture.filters import PathFilter
from layerdiff.capture.hparams import extra_repr_values, hyper_parameters, safe_extra_repr
from layerdiff.capture.ops import OpCapture, OpGradients, OpWindows, Producers, SourceFinder
from layerdiff.capture.options import TraceOptions
from layerdiff.capture.parts import ModelParts, each_named, parts_of
from layerdiff.capture.session import settled_stats
from layerdiff.capture.structure import replace_tensors, walk
from layerdiff.errors import LayerdiffError


class ForcePlan:
    """What one gradient tap swaps in under replay (``layerdiff bisect``): the reference's value for some of
    its tensors (forward) and, lazily, the reference's gradient for them (backward). None keeps the
    candidate's own. The candidate's graph still receives every gradient, so forcing never cuts backward."""

    def __init__(self, values, grads):
        self.values = values  # one framework tensor or None per tapped tensor
        self.grads = grads  # index -> framework tensor or None; called during backward

    def forward(self, tensors):
        return [t if v is None else v for t, v in zip(tensors, self.values)]

    def grad(self, index, own):
        forced = self.grads(index) if self.grads is not None else None
        return own if forced is None else forced

    def backward(self, grads):
        return tuple(self.grad(i, g) for i, g in enumerate(grads))


class DeclaredStep:
    """One step that the user declared (``Tracer.step()``): the root calls made while it lasts are its
    microbatches, as a pipeline schedule's call makes them (``TraceSession.starts_step``)."""

    def clear(self) -> None:
        """Nothing held: a schedule's frame is cleared once its step is over, this has nothing to let go."""


# what non-reentrant checkpointing raises to stop a recomputation once it has every tensor backward needs (torch's
# and MindSpore's "early stop"), through the calls it is in: control flow, not a failure of the model
RECOMPUTATION_STOPS = frozenset({"_StopRecomputationError"})


@mypyc_attr(allow_interpreted_subclasses=True)  # each adapter's ``Hooks`` (a compiled build: layerdiff/native.py)
class ModuleHooks:
    """The framework-independent half of an adapter's ``Hooks``: what a traced module call records, and when.

    Every framework calls a pre-hook and a post-hook around each module call; both walk the arguments / outputs,
    open and close the session's frame, and (when gradients are recorded) route differentiable tensors through a
    gradient tap whose aliases are swapped into the call. Subclasses supply only what differs per framework: how
    to list modules and parameters, register hooks, recognise tensors, apply the tap, detect in-place changes and
    parameter changes.
    """

    #: what the in-place warning says happens next (the torch and paddle taps have different consequences)
    in_place_consequence: ClassVar[str] = "its later calls record no grad_input"

    def __init__(self, adapter, model, session, options: TraceOptions, path_filter: PathFilter, forcer=None):
        self.adapter = adapter  # the framework's ``FrameworkAdapter``: tensors, modules, parameters
        self.model = model
        self.session = session
        self.forcer = forcer  # replay: supplies the reference's values and gradients (``replay.forcer``)
        self.backward = options.backward
        self.path_filter = path_filter
        self.record_params = options.params
        self.handles: list = []
        self.active = False  # hooks that cannot be removed (Paddle's parameter reduce hooks) check this
        self.open_frames: dict[int, list] = {}  # id(module) -> frames of its calls in progress (recursion)
        self.no_input_taps: set[str] = set()  # paths caught modifying a tapped input in place
        self.param_versions: dict[str, object] = {}
        # the statistics each parameter was last recorded with: after a backward pass, a parameter whose in-place
        # counter did not move is compared by them (``p.data -= lr * p.grad`` and Megatron's mixed-precision
        # optimizers, which copy into ``.data``, write without moving torch's ``_version``)
        self.param_stats: dict[str, Any] = {}
        self.param_fingerprints: dict[str, Any] = {}  # ... and then by a fingerprint of their bytes
        self.grads_since_recorded: set[str] = set()
        self.params = [(name, p) for name, p in self.named_parameters()
                       if path_filter(name.rpartition(".")[0])]
        # the key of each (name, parameter) in the books above: its name (a tied weight is booked under each of its
        # names), made unique where several model parts each name one of theirs alike (Megatron's model chunks name
        # their layers from 0)
        self.book: dict[tuple[str, int], str] = {}
        taken: set[str] = set()
        for name, p in self.params:
            if (name, id(p)) not in self.book:
                key, n = name, 1
                while key in taken:
                    key, n = f"{name}#{n}", n + 1
                self.book[(name, id(p))] = key
                taken.add(key)
        owners: dict = {}
        for name, p in self.params:
            owners.setdefault(id(p), []).append(name)
        self.tied = {name: names for names in owners.values() if len(names) > 1 for name in names}
        self.tied_in_module: dict[str, dict[int, str]] = {}  # module path -> {id(parameter): name}, its tied ones
        for name, p in self.params:
            if name in self.tied:
                self.tied_in_module.setdefault(name.rpartition(".")[0], {})[id(p)] = name
        self.module_types = {path: type(m).__name__ for path, m in self.named_modules()}
        self.busy = 0  # > 0 while a hook runs: the framework calls layerdiff's own code makes are no operations
        self.ops: OpCapture | None = None  # ``ops`` tracing: made by ``capture_ops`` (see ``capture.ops``)
        self.resumed_ops: dict[int, Any] = {}  # id(recomputed call's frame) -> interception resumed for it
        self.random_before: str | None = None  # the random generators' fingerprint when the root call opened
        self.call_hooks: dict[int, tuple[Callable, Callable]] = {}  # id(module) -> its (pre-hook, post-hook)
        self.bare = 0  # > 0 while a call runs without gradient taps or forced values (``checkpointed_forward``)
        self.op_windows: OpWindows | None = None
        self.no_ops: set[int] = set()  # id() of the framework's own leaf modules: no operations inside them
        self.declared_step: DeclaredStep | None = None  # ``Tracer.step()`` in progress: its root calls are one step
        # several model parts (``ModelParts``: the pipeline stages a schedule runs on this rank): each part and each
        # of its parameters' names -> the stage that part is, once the schedule says (``learn_stages``)
        self.root_stages: dict[int, int] = {}
        self.param_stages: dict[int, int] = {}  # id(parameter) -> stage
        self.param_part = {id(p): part for part in parts_of(model) for _, p in self.adapter.named_parameters(part)} \
            if isinstance(model, ModelParts) else {}

    def named_modules(self):
        """(path, module) for the model and all its submodules; the model itself has path '' (each part of
        ``ModelParts`` does)."""
        return each_named(self.model, self.adapter.named_modules, once_per_object=True)

    def named_parameters(self):
        """(name, parameter) of every parameter to record (a tied weight under each owner where the framework
        lists it so)."""
        return each_named(self.model, self.adapter.named_parameters)

    def learn_stages(self, stages: dict[int, int]) -> None:
        """Which pipeline stage each part of ``ModelParts`` is (``stages``: id(part) -> stage index): their calls
        and parameters are recorded with it from now on."""
        self.root_stages = dict(stages)
        self.param_stages = {key: stages[id(part)] for key, part in self.param_part.items() if id(part) in stages}

    # -- framework-specific: subclasses override these -------------------------------------------------------
    def differentiable(self, t) -> bool:
        """Whether a gradient can reach ``t`` (worth tapping). A method here, a static one in the subclasses: a
        compiled build calls a static method of its own class directly, whatever a subclass put in its place."""
        raise NotImplementedError

    def register_forward_hooks(self, module, pre_hook, post_hook) -> list:
        """Register ``pre_hook(module, args, kwargs)`` and ``post_hook(module, args, kwargs, output)`` (the latter
        also when forward raises, with ``output=None``); return the removable handles."""
        raise NotImplementedError

    def forward_function(self, module):
        """The function a call of ``module`` runs (its parameter names name the positional arguments)."""
        return getattr(module, "forward", None)

    def positional_names(self, module) -> tuple:
        try:
            signature = inspect.signature(self.forward_function(module))
        except (TypeError, ValueError):  # builtins and C functions may have no signature
            return ()
        return tuple(p.name for p in signature.parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    def register_param_grad_hooks(self):
        """Hooks that report each parameter's gradient (see ``record_param_grad``)."""
        raise NotImplementedError

    def grad_enabled(self) -> bool:
        """True while the framework records the forward for a backward pass."""
        raise NotImplementedError

    def apply_tap(self, tensors, report, frame, outputs: bool, plan: ForcePlan | None = None):
        """Route ``tensors`` through the framework's gradient tap (identity forward); return their aliases, one per
        tensor (None for one left in place: not tapped, or its gradient reported from the autograd node that made
        it). ``report(grads)`` must be called in backward with the gradients, aligned with ``tensors`` (None where
        none arrived). ``frame`` and ``outputs`` are for frameworks that gather per-tensor hooks themselves
        (MindSpore) or hook an output on the node that made it (torch: not where ``frame.inputs_as_given``). With a
        ``plan``, the aliases show the plan's values and the gradient passed on is the plan's (after ``report`` saw
        the own)."""
        raise NotImplementedError

    def sync(self):
        """Wait for asynchronously queued ops so that their errors surface now; eager frameworks have none."""

    # -- operations inside modules (``ops`` tracing): frameworks that support it override these ------------------
    def intercept_ops(self, capture: OpCapture) -> ContextManager[Any]:
        """While open, every framework function, tensor method and operator the model calls goes to
        ``capture.recording()`` / ``capture.run``; on exit everything is restored."""
        raise LayerdiffError(f"recording operations inside modules (--ops) is not available for "
                             f"{self.adapter.name} yet")

    def unseen(self) -> ContextManager[Any]:
        """While layerdiff's own hooks run under ``ops`` tracing: the framework calls they make skip the
        interceptor altogether (they are never operations; ``busy`` says so too, at a cost per call)."""
        return contextlib.nullcontext()

    def framework_leaf(self, module) -> bool:
        """A module of the framework itself (``nn.Linear``): its operations are the framework's, never recorded."""
        return False

    def named_buffers(self):
        """(name, buffer) of the model's buffers: producers of the tensors model code reads from them."""
        return ()

    def op_gradients(self) -> OpGradients | None:
        """How an operation's gradients are taken in this framework (None: forward only)."""
        return None

    def op_scalar(self, obj):
        """A non-tensor argument of an operation as JSON (a dtype as its name), or None to leave it out."""
        return None

    def op_framework_dirs(self) -> list[str]:
        """The framework's own source folders: a call made from there is not model code."""
        return []

    runner: Any = None  # a wrapper found running the model (DDP's), whose facts (its gradients' placement) hold

    def first_call(self, frame) -> None:
        """Runs at the trace's first call of the model (``frame``: this hook's): what the calls around it say."""

    def scheduled_step(self, scope) -> None:
        """Runs as a step that a schedule runs as microbatches begins (``scope``: ``FrameworkAdapter.step_scope``'s):
        what the schedule says about the model."""

    def machinery_call(self, frame) -> bool:
        """Whether a call of the model made now (``frame``: this hook's, with no call of it open) is the framework's
        machinery running the model for its own purposes (a pipeline stage learning its tensors' shapes on
        placeholder values): not recorded, nor anything it calls."""
        return False

    def recomputing(self, frame) -> bool:
        """Whether a call of the model made now (``frame``: this hook's, with no call of it open) re-runs, during
        backward, a forward pass that activation checkpointing did not keep: its calls are the calls it replays,
        recorded apart (``recompute``), not a new step. Here: it runs inside the ``backward(ctx, ...)`` of a
        custom autograd function (torch's ``Function``, Paddle's ``PyLayer``), where reentrant checkpointing
        recomputes (torch's, Megatron's, DeepSpeed's ``CheckpointFunction``, Paddle's ``RecomputeFunction``): no
        model runs its forward there otherwise."""
        while frame is not None:
            code = frame.f_code
            if code.co_name == "backward" and code.co_argcount and code.co_varnames[0] == "ctx":
                return True
            frame = frame.f_back
        return False

    def compute_dtypes(self, module) -> set[str]:
        """The dtypes ``module``'s own parameters have at this call where the model holds them in others: a wrapper
        that casts them for computing (FSDP's ``MixedPrecisionPolicy``) is mixed precision, as autocast is."""
        return set()

    def module_parameters(self, module) -> Iterable[tuple[str, Any]]:
        """(name, parameter) of the parameters ``module`` holds itself now, not its children's."""
        return ()

    def op_machinery_dirs(self) -> list[str]:
        """Folders of the framework's machinery around a model (data-parallel wrappers, tensor-parallel hooks): the
        operations it runs on the model's way (FSDP gathering weights before a layer) are none of the model's."""
        return []

    def capture_ops(self, windows: OpWindows) -> ContextManager[Any]:
        """Start recording the operations inside the module calls ``windows`` selects: producers and the
        framework's interceptor. Called by the tracer after ``install``; the context it returns is open while
        the trace is."""
        self.op_windows = windows
        params = {id(p): name for name, p in self.named_parameters()}
        buffers = {id(b): name for name, b in self.named_buffers()}
        self.ops = OpCapture(self.session, self, self.adapter.is_tensor, self.op_scalar,
                             SourceFinder(self.op_framework_dirs(), self.op_machinery_dirs()),
                             Producers(params, buffers),
                             self.op_gradients() if self.backward else None)
        self.no_ops = {id(m) for _, m in self.named_modules() if self.framework_leaf(m)}
        return self.intercept_ops(self.ops)

    def watch_inputs(self, frame, needs, swap):
        """Before the call runs: note what ``check_in_place`` needs to see whether it modified tapped inputs."""

    def check_in_place(self, frame) -> bool:
        """After the call: True if it modified a tapped input in place (after any framework-specific repair)."""
        return False

    def watch_param_uses(self, frame, module, outputs):
        """After the call: arrange for this call's own contribution to each tied parameter's gradient to reach
        ``session.param_use`` in backward; frameworks whose autograd graph cannot be inspected skip it."""

    def param_version(self, p):
        """A value that changes whenever ``p``'s bytes change, or None if the framework has no such counter.

        Without one, a parameter's value is written at the first step and again at the start of each step
        that follows a backward pass which produced its gradient (when an optimizer may have changed it):
        no per-step checksum of every weight. A change made with no backward pass in between (set_value,
        load_state_dict during one trace) is not seen: start a new trace after loading weights. With one, a
        parameter whose counter did not move after such a backward pass is compared by its statistics too
        (``param_stats``): writes through ``.data`` move no counter.
        """
        return None

    def _written_unseen(self, candidates: list) -> list:
        """The (name, parameter, version) of ``candidates`` that changed since they were last recorded though their
        in-place counters did not move: the first time, by the statistics they were recorded with; then by a
        fingerprint of their values taken at that first check (``FrameworkAdapter.fingerprints``: one fast read of
        each, and on a device one transfer for all, not four reductions and a synchronization each: measured
        0.38 ms against 1.4 ms a step for the 3.7M weights of a small Llama on the CPU, backward without updates)."""
        if not candidates:
            return []
        fingerprints = self.adapter.fingerprints([p for _, p, _ in candidates])
        changed = []
        for (name, p, version), fingerprint in zip(candidates, fingerprints):
            key = self.book.get((name, id(p)), name)
            known = self.param_fingerprints.get(key)
            self.param_fingerprints[key] = fingerprint
            if (self.session.peek_stats(p) != self.param_stats.get(key)) if known is None else fingerprint != known:
                changed.append((name, p, version))
        return changed

    def start_step(self):
        """Runs before the outermost call of each step."""
        if self.record_params:
            self._record_changed_params()

    # -- installation --------------------------------------------------------------------------------------
    def install(self):
        self.active = True
        roots = {id(part) for part in parts_of(self.model)}
        for path, module in self.named_modules():
            selected = self.path_filter(path)
            if id(module) not in roots and not selected:
                continue
            # the model itself is always hooked (it delimits steps), with statistics only when not selected
            pre_hook = self._pre_hook(path, type(module).__name__, selected, self.positional_names(module))
            post_hook = self._post_hook(path)
            self.call_hooks[id(module)] = (pre_hook, post_hook)
            self.handles.extend(self.register_forward_hooks(module, pre_hook, post_hook))
        if self.backward and self.record_params:
            self.register_param_grad_hooks()
        self.handles.extend(self.watch_hidden_writes())

    def watch_hidden_writes(self) -> list:
        """Handles (each with ``remove()``) of what tells the session when the framework writes into a tensor without
        its in-place counter seeing it (``TraceSession.forget``): torch.distributed's collectives do."""
        return []

    def remove(self):
        self.active = False
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- hooks ---------------------------------------------------------------------------------------------
    def _pre_hook(self, path, type_name, full=True, arg_names=()):
        session = self.session
        is_tensor = self.adapter.is_tensor
        # hyper-parameters are read again in every step (they may change); the extra repr is parsed when it does
        read: dict[str, Any] = {"step": None, "hparams": {}, "repr": None, "repr_values": {}}

        def hook(module, args, kwargs):
            self.busy += 1
            try:
                if self.ops is None:
                    return opened(module, args, kwargs)
                with self.unseen():
                    return opened(module, args, kwargs)
            finally:
                self.busy -= 1

        def opened(module, args, kwargs):
            self.sync()  # a failure of an op queued before this call surfaces here, in the caller's frame
            scope = None
            recompute = False
            if not session.stack:
                opens = self._root_call(sys._getframe())  # never a local: a frame holding itself lives until the
                # garbage collector's full pass, and with it every frame out from it and their values (the model's
                # outputs, its inputs)
                if opens is None:
                    return None  # not the model's work: neither it nor what it calls is recorded
                recompute, scope = opens
                self.random_before = None if recompute else self.adapter.random_state()
            step = session.step + (0 if session.stack or recompute or not session.starts_step(scope) else 1)
            autocast = self.adapter.autocast_dtypes()
            if autocast:
                session.autocast.update(autocast)
            cast = self.compute_dtypes(module)
            if cast:
                session.autocast.update(cast)
            if read["step"] != step:
                text = safe_extra_repr(module)
                if text != read["repr"]:
                    read["repr"], read["repr_values"] = text, extra_repr_values(text)
                read["step"], read["hparams"] = step, hyper_parameters(module, read["repr_values"])
            tensors: list = []
            scalars: dict[str, Any] = {}
            walk(args, "args", is_tensor, lambda k, t: tensors.append((k, t)), scalars.__setitem__)
            walk(kwargs, "kwargs", is_tensor, lambda k, t: tensors.append((k, t)), scalars.__setitem__)
            frame = session.begin_call(path, type_name, read["hparams"], tensors, scalars, full, arg_names, scope,
                                       self.root_stages.get(id(module)) if not session.stack else None, recompute)
            self.open_frames.setdefault(id(module), []).append(frame)
            ops = self.ops
            if ops is not None:
                self._open_for_ops(ops, frame, module, path, tensors)
                if recompute:  # the interceptor may be off in backward: on again for the call's own code
                    resumed = ops.resumed()
                    resumed.__enter__()
                    self.resumed_ops[id(frame)] = resumed
            forced = self._forced(frame, "input", tensors, frame.inputs)
            swap = {}
            if self._taps_enabled():
                if getattr(module, "inplace", False) is True or path in self.no_input_taps:
                    frame.inputs_as_given = True  # the module may write them: a tap's alias would hide it
                else:
                    needs = [(k, t) for k, t in tensors if self.differentiable(t)]
                    if needs:
                        frame.tapped_inputs = True
                        swap = self._tap(needs, session.grad_inputs, frame, outputs=False, forced=forced)
                        if not forced:
                            self.watch_inputs(frame, needs, swap)
            self._swap_untapped(tensors, forced, swap)
            if ops is not None and frame.ops is not None:  # what the module's code receives: its inputs
                for key, t in tensors:
                    ops.producers.register(frame, swap.get(id(t), t), {"kind": "input", "key": key})
            if not swap:
                return None
            return replace_tensors(args, is_tensor, swap), replace_tensors(kwargs, is_tensor, swap)

        return hook

    def _root_call(self, here) -> tuple[bool, Any] | None:
        """A root call opening (``here``: its pre-hook's frame): None when it is the framework's machinery rather
        than the model's work; else whether activation checkpointing recomputes this step's calls in it (no new
        step), and the scope that says which step it belongs to (``TraceSession.starts_step``), the step started."""
        session = self.session
        if self.machinery_call(here):
            return None
        if session.step >= 0 and self.recomputing(here):
            return True, None
        if session.step < 0:
            self.first_call(here)
        scope = self.declared_step or self.adapter.step_scope(here)
        if scope is None and isinstance(self.model, ModelParts):
            session.warn("several modules traced together, called outside a pipeline schedule: their calls are not "
                         "told apart by stage (trace the stage modules a schedule runs on a rank)")
        if session.starts_step(scope):
            if scope is not None:  # first: the stage it says each part is tags the parameters' records
                self.scheduled_step(scope)
            self.start_step()
        return False, scope

    def _open_for_ops(self, ops: OpCapture, frame, module, path: str, tensors: list) -> None:
        """A call opened under ``ops`` tracing: where its inputs came from in the caller's code, and whether its own
        code's operations are recorded."""
        stack = self.session.stack
        caller = stack[-2] if len(stack) > 1 else None
        if caller is not None and caller.ops is not None:
            frame.producers = {key: ops.producers.lookup(caller, t, stack[:-1]) for key, t in tensors}
        if self.op_windows is not None and self.op_windows(path) and id(module) not in self.no_ops:
            frame.ops = 0
            for name, p in self.module_parameters(module):  # one swapped in for this call (FSDP's gathered weight)
                if id(p) not in ops.producers.params:
                    ops.producers.register(frame, p, {"kind": "param", "name": f"{path}.{name}" if path else name})

    def _post_hook(self, path):
        session = self.session
        is_tensor = self.adapter.is_tensor

        def hook(module, args, kwargs, output):
            self.busy += 1
            try:
                if self.ops is None:
                    return closed(module, output)
                with self.unseen():
                    return closed(module, output)
            finally:
                self.busy -= 1

        def closed(module, output):
            stack = self.open_frames.get(id(module))
            if not stack:
                return None
            frame = stack.pop()
            ops = self.ops
            resumed = self.resumed_ops.pop(id(frame), None)
            if resumed is not None:
                resumed.__exit__(None, None, None)
            error = sys.exc_info()[1]
            if output is None and error is not None:
                if ops is not None:
                    ops.producers.drop(frame)
                if frame.replay is not None and type(error).__name__ in RECOMPUTATION_STOPS:
                    session.stop_call(frame)  # no failure: the checkpoint has what backward needs
                else:
                    session.fail_call(frame, error)
                return None
            try:
                self.sync()  # asynchronous frameworks: make this module's own errors surface in its frame
            except Exception as exc:
                if ops is not None:
                    ops.producers.drop(frame)
                session.fail_call(frame, exc)
                raise
            tensors: list = []
            scalars: dict[str, Any] = {}
            walk(output, "out", is_tensor, lambda k, t: tensors.append((k, t)), scalars.__setitem__)
            if ops is not None and frame.ops is not None:  # where what it returns was made in its own code
                for key, t in tensors:
                    frame.producers[key] = ops.producers.lookup(frame, t, session.stack)
            if ops is not None:
                ops.producers.drop(frame)
            entries = session.end_call(frame, tensors, scalars)
            if not session.stack and self.random_before is not None:  # a root call's forward ended
                session.saw_random(self.adapter.random_state() != self.random_before)
                self.random_before = None
            if path in self.tied_in_module and self._taps_enabled() and self.record_params:
                self.watch_param_uses(frame, module, [t for _, t in tensors])
            modified = self.check_in_place(frame)
            # the inputs watched are let go with the call: the frame lives on in its gradient taps' closures until
            # backward frees them, and a reference cycle (torch's multi-gradient hooks on a composite operation's
            # tensors) held a whole step's graph, and so every call's inputs, until the garbage collector's
            # rare full pass: the toy's ``--ops`` trace grew from 500 to 900 MB over 35 steps, page-faulting
            frame.versions = []
            if modified:
                self.no_input_taps.add(path)
                session.warn(f"{path} modifies its input in place: {self.in_place_consequence}")
            forced = self._forced(frame, "output", tensors, entries)
            swap = {}
            if self._taps_enabled():
                needs = [(k, t) for k, t in tensors if self.differentiable(t)]
                if needs:
                    swap = self._tap(needs, session.grad_outputs, frame, outputs=True, forced=forced)
            self._swap_untapped(tensors, forced, swap)
            caller = session.stack[-1] if ops is not None and session.stack else None
            if ops is not None and caller is not None and caller.ops is not None:  # the caller's code receives it
                for key, t in tensors:
                    ops.producers.register(caller, swap.get(id(t), t),
                                           {"kind": "call", "path": path, "call": frame.call, "key": key})
            return replace_tensors(output, is_tensor, swap) if swap else None

        return hook

    def _taps_enabled(self) -> bool:
        return self.backward and not self.bare and self.grad_enabled()

    def checkpointed_forward(self, function: Callable, module) -> Callable:
        """``function`` (``module``'s forward, which reentrant activation checkpointing was given rather than the
        module: transformers checkpoints ``forward``, so the module's hooks run outside the checkpoint), run in a
        recomputed call of ``module`` when backward recomputes it. Without that call, the operations of the
        module's own code that backward runs again belong to no call and go unrecorded, and so does their
        backward, which runs only through the recomputed graph (residual additions of every checkpointed decoder
        layer). The call is bare: the call it replays already routes the module's gradients and forced values."""
        hooks = self.call_hooks.get(id(module))
        if hooks is None:
            return function
        pre_hook, post_hook = hooks
        session = self.session

        def run(*args, **kwargs):
            if session.stack or not self.active or not self.recomputing(sys._getframe()):
                return function(*args, **kwargs)  # the forward pass itself: the module's call is open around it
            with self._bare():
                pre_hook(module, args, kwargs)
            try:
                output = function(*args, **kwargs)  # the calls inside are recorded as ever (their taps too)
            except BaseException:
                with self._bare():
                    post_hook(module, args, kwargs, None)
                raise
            with self._bare():
                post_hook(module, args, kwargs, output)
            return output

        return run

    @contextlib.contextmanager
    def _bare(self):
        self.bare += 1
        try:
            yield
        finally:
            self.bare -= 1

    def _tap(self, needs, sink, frame, outputs: bool, forced: dict) -> dict:
        """Route ``needs`` [(key, tensor)] through one gradient tap; {id(original): alias} to swap them in."""
        keys = [k for k, _ in needs]
        plan = self._plan(frame, needs, forced, "grad_output" if outputs else "grad_input")
        aliases = self.apply_tap([t for _, t in needs],
                                 lambda grads: sink(frame, [(k, g) for k, g in zip(keys, grads) if g is not None]),
                                 frame, outputs, plan)
        swap = {}
        for (key, t), alias in zip(needs, aliases):
            if alias is None:
                continue
            if key not in forced:  # a forced alias shows the reference's bytes, not the original's
                self.session.remember_alias(t, alias)
            swap[id(t)] = alias
        return swap

    # -- replay (a forcer is set only by ``layerdiff bisect``) -----------------------------------------------
    def _forced(self, frame, role: str, tensors, entries) -> dict:
        """{key: framework tensor}: the reference's values for this call's inputs or outputs."""
        if self.forcer is None or self.bare:
            return {}
        arrays = self.forcer.forward(frame, role, entries)
        return {k: self.adapter.to_framework(arrays[k], t) for k, t in tensors if k in arrays}

    def _plan(self, frame, needs, forced: dict, grad_role: str) -> ForcePlan | None:
        if self.forcer is None:
            return None
        values = [forced.get(k) for k, _ in needs]
        forcer, to_framework = self.forcer, self.adapter.to_framework

        def reference_grad(index):
            key, like = needs[index]
            array = forcer.gradient(frame, grad_role, key)
            return None if array is None else to_framework(array, like)

        return ForcePlan(values, reference_grad if forcer.backward else None)

    @staticmethod
    def _swap_untapped(tensors, forced: dict, swap: dict):
        """Forced tensors that took no gradient tap (integers, no-grad floats) are replaced directly."""
        for key, t in tensors:
            if key in forced and id(t) not in swap:
                swap[id(t)] = forced[key]

    def record_param_grad(self, name, grad, param=None, increment: bool = False):
        """``param``: the parameter itself, where the framework's hook hands it (what its gradient is: a partial
        sum over ranks, one backward's contribution); ``increment``: ``grad`` is one backward's contribution,
        before it is added to the parameter's gradient."""
        if grad is not None:
            self.grads_since_recorded.add(self.book.get((name, id(param)), name))
            module = name.rpartition(".")[0]
            runner = self.runner if self.runner is not None else self.param_part.get(id(param), self.model)
            placement = self.adapter.grad_placement(runner, param) if param is not None else None
            increment = increment or (param is not None and self.adapter.grad_increments(param))
            self.session.param("param_grad", name, module, grad, self.module_types.get(module), self.tied.get(name),
                               placement, increment, self.param_stages.get(id(param)))

    def _record_changed_params(self):
        """Parameter values at the start of each step, when they (may have) changed since last recorded."""
        unseen = []  # (name, parameter, version): a backward pass ran, and its in-place counter did not move
        for name, p in self.params:
            key = self.book.get((name, id(p)), name)
            version = self.param_version(p)
            if version is None:
                changed = key not in self.param_versions or key in self.grads_since_recorded
            else:
                changed = self.param_versions.get(key) != version
                if not changed and key in self.grads_since_recorded:
                    unseen.append((name, p, version))
                elif changed:
                    self.param_fingerprints.pop(key, None)
            self.grads_since_recorded.discard(key)
            if changed:
                self._record_param(name, p, version)
        for name, p, version in self._written_unseen(unseen):
            self._record_param(name, p, version)

    def _record_param(self, name: str, p, version) -> None:
        key = self.book.get((name, id(p)), name)
        self.param_versions[key] = version
        module = name.rpartition(".")[0]
        entries = self.session.param("param", name, module, p, self.module_types.get(module), self.tied.get(name),
                                     stage=self.param_stages.get(id(p)))
        if version is not None:
            self.param_stats[key] = settled_stats(entries[0]["stats"]) if entries else None
