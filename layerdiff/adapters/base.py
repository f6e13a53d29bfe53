"""The one contract between layerdiff and a framework: what an adapter provides, in one abstract class.

Everything the rest of layerdiff asks of a framework goes through a ``FrameworkAdapter`` from the registry
(``adapters.load_adapter``): tensor access for the trace session (stored bits, identity, statistics, placement),
the hooks that trace a model, the run's metadata and place among ranks, and weight transfer. The facts about how a
framework *lays out* a model (weights stored transposed, the class names of its containers) are data in the rule
sets (``match/rulesets``), so a trace is read without its framework installed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping, Sequence, TypedDict

import numpy as np

from layerdiff.capture import hparams
from layerdiff.runs.parallel import ParallelLayout
from layerdiff.tracefile.checksums import digest

if TYPE_CHECKING:
    from layerdiff.capture.filters import PathFilter
    from layerdiff.capture.hooks import ModuleHooks
    from layerdiff.capture.options import TraceOptions
    from layerdiff.capture.session import TraceSession


class RankPlace(TypedDict):
    """This process's place in a job of several ranks."""
    rank: int
    world_size: int
    backend: str
    local_rank: int


class FrameworkAdapter(ABC):
    """One framework, as layerdiff sees it. An adapter module imports its framework; nothing else does."""

    name: ClassVar[str]  # "torch", "paddle", "mindspore": the framework's name in traces and rule sets

    # -- tensors (what the trace session reads; ``capture.session.TensorAccess``) ----------------------------
    @abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """Whether ``obj`` is one of this framework's tensors."""

    @abstractmethod
    def dtype_name(self, t: Any) -> str | None:
        """The trace's name of the tensor's dtype ("bfloat16", "float8_e4m3fn", ...), None if a trace cannot hold it."""

    @abstractmethod
    def to_stored(self, t: Any) -> tuple[np.ndarray[Any, Any], str] | None:
        """(numpy array of the tensor's bits, dtype name), or None if it cannot be stored."""

    def identify(self, t: Any) -> Any:
        """A hashable key equal for two tensors only while they show the same bytes (storage, shape, strides,
        dtype, in-place version), or None where the framework cannot tell (every tensor is then stored)."""
        return None

    def version(self, t: Any) -> int | None:
        """A counter that changes whenever ``t``'s bytes change in place (torch's ``_version``), for tensors that
        ``identify`` knows; None where there is none (the tensor is then known by ``identify`` alone)."""
        return None

    #: whether ``identify`` holds for gradients in backward too; False where the framework's backward kernels may
    #: write into a live gradient's buffer without bumping its version (Paddle reuses them in place)
    gradients_keep_identity: ClassVar[bool] = True

    def fast_stats(self, t: Any) -> Mapping[str, Any] | None:
        """The tensor's summary statistics reduced by the framework itself, or None to take them with numpy."""
        return None

    def deferral(self) -> Any:
        """A trace's own ``capture.session.StatsDeferral``: statistics of tensors on an accelerator left there until
        read back in batches; None where the framework summarizes every tensor at once."""
        return None

    def fingerprints(self, ts: list[Any]) -> list[Any]:
        """Per tensor, a value that changes when its values do, read cheaply: a hash of its stored bytes (None for
        a tensor that cannot be stored). What tells a parameter written without the framework's in-place counter
        moving (``p.data -= ...``) from one left as it was."""
        out: list[Any] = []
        for t in ts:
            stored = self.to_stored(t)
            out.append(None if stored is None else (stored[1], stored[0].shape,
                                                    digest(np.ascontiguousarray(stored[0]))))
        return out

    def autocast_dtypes(self) -> list[str]:
        """The dtypes automatic mixed precision computes in right now (``torch.autocast``, ``paddle.amp.auto_cast``),
        empty while it is off. A run under it keeps float32 tensors (its residual stream, its upcasts) that are
        computed from those dtypes' results: they are judged at that dtype's tolerance (``precision_floor``)."""
        return []

    def random_state(self) -> str | None:
        """A fingerprint of the framework's random generators now (``metadata``'s ``rng_state``), or None where the
        adapter cannot take one. Taken around each root call: a forward that left it as it was drew no random
        numbers (no dropout mask), and two runs' other random states then explain nothing (``rng_drawn``)."""
        return None

    def describe(self, t: Any) -> tuple[str, list[int]]:
        """(dtype name, shape) of the tensor as ``to_stored`` keeps it (of what ``fast_stats`` summarized): lets
        "stats" mode skip the host copy."""
        raise NotImplementedError(f"{self.name}: fast_stats without describe")

    def plus_bias(self, output: Any, bias: Any) -> Any:
        """``output + bias`` (the bias of its last size) as a tensor outside any gradient graph, or None where the
        adapter cannot add them: what a statistics trace records of a module that returns ``(output, bias)`` for
        its caller to add (``tracefile.records.OUTPUT_PLUS_BIAS``)."""
        return None

    def placement(self, t: Any) -> dict[str, Any] | None:
        """How a distributed tensor is spread over ranks (``{"placements": ["S(0)"], "mesh": [2], "coord": [1],
        "global_shape": [...]}``), or None: the stored bytes are then this rank's local part."""
        return None

    # -- the model -----------------------------------------------------------------------------------------
    @abstractmethod
    def named_modules(self, model: Any) -> Iterable[tuple[str, Any]]:
        """(path, module) for the model and all its submodules in the model's own order; the model itself is ''."""

    @abstractmethod
    def named_parameters(self, model: Any) -> Iterable[tuple[str, Any]]:
        """(name, parameter) of the model's parameters, each once."""

    def module_paths(self, model: Any) -> list[str]:
        """Every module's path, the model itself first as ''."""
        return [path for path, _ in self.named_modules(model)]

    def parameters(self, model: Any) -> list[tuple[str, Any, str | None]]:
        """(name, parameter, type name of its module) for weight transfer."""
        return hparams.typed_parameters(self.named_modules(model), self.named_parameters(model))

    def module_entries(self, model: Any) -> list[hparams.ModuleEntry]:
        """(path, type name, hyper-parameters, [(parameter leaf, shape)]) of every module, in the model's order:
        what weight transfer matches a model's modules by."""
        return hparams.module_entries(self.named_modules(model), self.named_parameters(model))

    # -- tracing ---------------------------------------------------------------------------------------------
    #: the framework's half of the hooks (a ``ModuleHooks`` subclass: how it registers hooks and taps gradients)
    hooks_class: ClassVar[type[ModuleHooks]]
    #: whether its hooks record the operations inside modules (``ops`` tracing: ``ModuleHooks.intercept_ops``)
    records_ops: ClassVar[bool] = False

    def hooks(self, model: Any, session: TraceSession, options: TraceOptions, path_filter: PathFilter,
              forcer: Any = None) -> ModuleHooks:
        """The hooks that trace ``model`` into ``session`` (installed by the tracer, removed on exit)."""
        return self.hooks_class(self, model, session, options, path_filter, forcer)

    @abstractmethod
    def metadata(self, model: Any) -> dict[str, Any]:
        """Framework, version, devices, dtypes, seeds and determinism switches: what explains most mismatches."""

    @abstractmethod
    def distributed(self) -> RankPlace | None:
        """This process's place in a job of several ranks (None when it runs alone)."""

    def parallel_layout(self, model: Any) -> ParallelLayout | None:
        """The model's place in a model-parallel layout (Megatron's tensor, pipeline, expert, data parallel groups,
        and the global names of its locally named modules), from the framework's own facts; None without one."""
        return None

    def parts_layout(self, parts: Sequence[Any]) -> tuple[ParallelLayout, dict[int, int]] | None:
        """The layout of several modules traced together (``ModelParts``) as far as the framework's facts say it
        before they run, with each one's pipeline stage (id(module) -> index): Megatron's model chunks (virtual
        pipeline stages). None: not known (a pipeline schedule may say it at its first step)."""
        return None

    def step_scope(self, frame: FrameType | None) -> Any:
        """What makes the root calls made from ``frame`` one step (the running call of a pipeline schedule, whose
        microbatches each call the model), or None: each root call is a step of its own."""
        return None

    def grad_placement(self, model: Any, param: Any) -> dict[str, Any] | None:
        """How ``param``'s gradient, as its hook sees it, is spread over ranks when the gradient's own tensor
        cannot say: a partial sum each rank holds until the framework adds them up (``{"placements": ["P(sum)"],
        ..., "scale": 0.5}``); None: as the parameter is."""
        return None

    def grad_increments(self, param: Any) -> bool:
        """Whether ``param``'s gradient, as its hook sees it, is one backward's contribution that the training code
        adds up elsewhere (not the running total of the step's backward passes)."""
        return False

    # -- weights ---------------------------------------------------------------------------------------------
    @abstractmethod
    def assign(self, param: Any, array: np.ndarray[Any, Any], dtype: str) -> None:
        """Copy stored bits into a parameter (cast to the parameter's dtype if they differ)."""

    @abstractmethod
    def to_framework(self, array: np.ndarray[Any, Any], like: Any) -> Any:
        """A tensor holding ``array``'s values with ``like``'s dtype and device (a reference value for replay)."""
