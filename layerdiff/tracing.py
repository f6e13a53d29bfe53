"""The public tracing entry point: ``with layerdiff.trace(model, "run.h5"): ...``."""
from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, ContextManager, Iterator

from layerdiff.adapters import detect_framework, load_adapter
from layerdiff.adapters.base import RankPlace
from layerdiff.capture.filters import PathFilter
from layerdiff.capture.hooks import DeclaredStep, ModuleHooks
from layerdiff.capture.hparams import model_config
from layerdiff.capture.ops import OpWindows
from layerdiff.capture.options import TraceOptions
from layerdiff.capture.parts import ModelParts, model_parts, parts_of
from layerdiff.capture.session import TraceSession
from layerdiff.errors import LayerdiffError
from layerdiff.tracefile.writer import TraceWriter
from layerdiff.version import __version__


class Tracer:
    """Context manager that hooks every module of ``model`` and streams a trace to ``path``.

    The framework is detected from the model. Hooks are removed and the file is closed on exit, also when
    the body raises; the exception and the modules active when it was raised are recorded, then re-raised.
    """

    def __init__(self, model, path, options: TraceOptions | None = None, *, forcer=None):
        try:
            self.model = model_parts(model)  # a list of modules: the pipeline stages one rank runs
        except ValueError as exc:
            raise LayerdiffError(str(exc)) from None
        self.path = os.fspath(path)
        self.options = options or TraceOptions()
        frameworks = {detect_framework(part) for part in parts_of(self.model)}
        if len(frameworks) > 1:
            raise LayerdiffError(f"the model parts traced together belong to several frameworks: "
                                 f"{', '.join(sorted(frameworks))}")
        if forcer is not None and isinstance(self.model, ModelParts):
            raise LayerdiffError("replay drives one module: give the model, not a list of its parts")
        self.adapter = load_adapter(frameworks.pop())
        self.forcer = forcer  # replay (layerdiff bisect): swaps in a reference run's values
        self.session: TraceSession | None = None
        self._hooks: ModuleHooks | None = None
        self._ops: ContextManager[Any] | None = None  # the framework's interceptor of operations, while open
        self._froze = False  # the garbage collector's view frozen by this trace (see __enter__)

    def __enter__(self):
        adapter, options = self.adapter, self.options
        parts = parts_of(self.model)
        meta = run_metadata()
        meta.update(adapter.metadata(parts[0]))
        if len(parts) > 1:
            meta["model_parts"] = len(parts)
            if "num_parameters" in meta:  # each parameter once, also one that several parts share
                unique = {id(p): p for part in parts for _, p in adapter.named_parameters(part)}
                meta["num_parameters"] = sum(math.prod(p.shape) for p in unique.values())
        config = next((found for found in map(model_config, parts) if found is not None), None)
        if config is not None:
            meta["model_config"] = config
        meta.update(mode=options.mode, options=options.recorded(), user=options.meta)
        paths = list(dict.fromkeys(path for part in parts for path in adapter.module_paths(part)))
        try:  # resolves filters, a --layers window and --ops-in against the model's modules, before any file exists
            path_filter = PathFilter.of(options, paths)
            windows = OpWindows(options.ops, paths) if options.ops else None
        except ValueError as exc:
            raise LayerdiffError(str(exc)) from None
        if windows is not None and not adapter.records_ops:
            raise LayerdiffError(f"recording operations inside modules (--ops) is not available for {adapter.name} "
                                 "yet")
        meta["window"] = path_filter.window_paths
        ranks = adapter.distributed()
        if ranks is not None and options.one_process:
            raise LayerdiffError(f"bisect replays the candidate in one process; this one runs as rank {ranks['rank']} "
                                 f"of {ranks['world_size']}: replay a single-process build of it against the "
                                 "reference, or align the multi-rank run (layerdiff align REF RUN)")
        meta["distributed"] = ranks
        layout = adapter.parallel_layout(parts[0])
        stages = None
        if len(parts) > 1:  # Megatron's model chunks say their stages now; a pipeline schedule, at its first step
            found = adapter.parts_layout(parts)
            if found is not None:
                layout, stages = found
        if layout is not None:
            meta["parallel"] = layout
        writer = TraceWriter(self._file_path(ranks), meta, overwrite=options.overwrite,
                             compression=options.compression, flush_interval=options.flush_interval,
                             write_behind=int(options.write_behind_mb * 2**20), held_records=options.held_records)
        self.session = TraceSession(writer, adapter, options.mode)
        # What exists now (the model, the framework, the user's objects) is moved out of the garbage collector's
        # sight while the trace is open: a traced step allocates many short-lived records, and each full
        # collection would walk all of it again (measured: a fifth of the cost of recording operations).
        # Not where the program froze objects itself; undone on exit.
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()
        hooks = adapter.hooks(self.model, self.session, options, path_filter, self.forcer)
        if stages is not None:
            hooks.learn_stages(stages)
        hooks.install()
        self._hooks = hooks
        if windows is not None:
            try:
                self._ops = hooks.capture_ops(windows)
                self._ops.__enter__()
            except BaseException:
                self._ops = None
                hooks.remove()
                self.session.close(None)
                if self._froze:
                    self._froze = False
                    gc.unfreeze()
                raise
        return self

    def _file_path(self, ranks: RankPlace | None) -> str:
        """The trace file: ``path`` itself, or, in a job of several ranks, ``path/rank{R}.h5`` (one directory per
        run, one file per rank: the same call in every rank never clobbers another rank's trace)."""
        run = Path(self.path)
        if ranks is None:
            if run.is_dir():
                raise LayerdiffError(f"{run} is a directory (a multi-rank run?); name a trace file")
            return self.path
        if run.exists() and not run.is_dir():
            raise LayerdiffError(f"{run} is a file; a run of {ranks['world_size']} ranks writes one trace per rank "
                                 f"into a directory of that name")
        try:
            run.mkdir(exist_ok=True)
        except OSError as exc:
            raise LayerdiffError(f"cannot create the run directory {run}: {exc.strerror or exc}") from None
        return str(run / f"rank{ranks['rank']}.h5")

    @property
    def writer(self) -> TraceWriter:
        """The trace's writer, once the trace is open."""
        if self.session is None:
            raise LayerdiffError("the trace is not open")
        return self.session.writer

    @property
    def failure(self) -> dict | None:
        """Where the traced run raised, once it has (the innermost module and the error)."""
        return self.session.failure if self.session is not None else None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The model's calls made inside are one step, each root call a microbatch of it: gradient accumulation.
        Compared with a run that took the whole batch in one call, a step's microbatches are joined along the batch
        axis, a loss (a floating scalar the model returns) is the microbatches' losses each weighted by the
        gradient its backward started from (their mean without a backward), whose gradient is then 1, and a
        parameter's gradient is the step's running total after the last microbatch. Megatron's pipeline schedules
        are found without it."""
        hooks = self._hooks
        if hooks is None:
            raise LayerdiffError("the trace is not open: call step() inside `with layerdiff.trace(...) as t:`")
        if hooks.declared_step is not None:
            raise LayerdiffError("steps do not nest: one `with t.step():` at a time")
        hooks.declared_step = DeclaredStep()
        try:
            yield
        finally:
            hooks.declared_step = None

    def flush(self):
        if self.session is not None:
            self.session.flush_deferred()  # statistics still on the device, and the records that wait for them
        self.writer.flush()

    def __exit__(self, exc_type, exc, tb):
        if self._ops is not None:
            ops, self._ops = self._ops, None
            ops.__exit__(None, None, None)
        if self._hooks is not None:
            self._hooks.remove()
        try:
            if self.session is not None:
                self.session.close(exc)
        finally:
            if self._froze:
                self._froze = False
                gc.unfreeze()
        return False


def trace(model, path, *, forcer=None, **options) -> Tracer:
    """Trace every module call of ``model`` (forward and, by default, backward) into the HDF5 file ``path``.
    ``model`` may be a list of modules traced together: the pipeline stages a schedule runs on one rank
    (interleaved 1F1B: torchtitan's ``model_parts``), each keeping the whole model's module names.

    Options: mode="full"|"stats", backward=True, include/exclude (module-path regexes), layers=(start, end)
    (only blocks start..end-1 of the model's main module list: the second pass of two-pass tracing), overwrite=False,
    compression=None|"gzip"|"lzf", flush_interval=1.0 (seconds a record may wait in memory, held to be encoded and
    written with others: at most 256 are; 0 writes every record before the step goes on),
    params=True (parameter values and gradients), meta={...} (your own notes, stored in the trace),
    write_behind=MB (full mode: tensor bytes are written by a thread of their own through a ring of at most this
    size, 256 by default, which starts at 8 MB and grows while the disk falls behind, so the disk works while the
    model computes; 0, in either mode, writes every record before the
    step goes on, for hunting a crash that kills the process outright), ops=True (also every operation that the
    modules' own code runs: torch functions, tensor methods and operators, custom autograd functions, with their
    source line and where each input came from) or ops=["REGEX", ...] (only inside the modules whose path
    matches: the window a module-level report points at).
    """
    return Tracer(model, path, TraceOptions(**options), forcer=forcer)


def run_metadata() -> dict:
    return {
        "layerdiff_version": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "argv": list(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("CUBLAS_", "CUDA_", "NVIDIA_TF32", "OMP_", "MKL_", "PYTHONHASHSEED", "FLAGS_"))},
    }
