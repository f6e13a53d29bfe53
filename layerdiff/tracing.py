"""The public tracing entry point: ``with layerdiff.trace(model, "run.h5"): ...``."""
from __future__ import annotations

import os
import platform
import socket
import sys
import time
from pathlib import Path

from layerdiff.version import __version__
from layerdiff.adapters import detect_framework, load_adapter
from layerdiff.capture.filters import MODES, PathFilter
from layerdiff.capture.hparams import model_config
from layerdiff.capture.session import TraceSession
from layerdiff.errors import LayerdiffError
from layerdiff.tracefile.writer import TraceWriter

WRITE_BEHIND_MB = 256  # tensor data a full trace may hold in memory while the disk catches up


class Tracer:
    """Context manager that hooks every module of ``model`` and streams a trace to ``path``.

    The framework is detected from the model. Hooks are removed and the file is closed on exit, also when
    the body raises; the exception and the modules active when it was raised are recorded, then re-raised.
    """

    def __init__(self, model, path, *, mode: str = "full", backward: bool = True, include=None, exclude=None,
                 overwrite: bool = False, compression: str | None = None, flush_interval: float = 1.0,
                 params: bool = True, meta: dict | None = None, forcer=None, layers=None, one_process: bool = False,
                 strict_filters: bool = True, write_behind: float | None = None):
        if mode not in MODES:
            raise LayerdiffError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.model = model
        self.path = os.fspath(path)
        self.framework = detect_framework(model)
        if write_behind is None:
            write_behind = WRITE_BEHIND_MB if mode == "full" else 0
        if not (isinstance(write_behind, (int, float)) and 0 <= write_behind < 2**20):
            raise LayerdiffError(f"write_behind must be a number of MB >= 0 (0: every record is in the file before "
                                 f"the step goes on), not {write_behind!r}")
        self.options = dict(mode=mode, backward=backward, include=include, exclude=exclude,
                            compression=compression, flush_interval=flush_interval, params=params,
                            layers=list(layers) if layers is not None else None, write_behind=write_behind)
        self.overwrite = overwrite
        self.user_meta = meta or {}
        self.forcer = forcer  # replay (layerdiff bisect): swaps in a reference run's values
        self.one_process = one_process  # bisect's runs: a candidate spread over ranks is refused
        self.strict_filters = strict_filters
        self.session: TraceSession | None = None
        self._hooks = None

    def __enter__(self):
        adapter = load_adapter(self.framework)
        meta = run_metadata()
        meta.update(adapter.metadata(self.model))
        config = model_config(self.model)
        if config is not None:
            meta["model_config"] = config
        meta.update(mode=self.options["mode"], options=self.options, user=self.user_meta)
        try:  # resolves filters and a --layers window against the model's modules, before any file is created
            path_filter = PathFilter(self.options["include"], self.options["exclude"], self.options["layers"],
                                     self.strict_filters)
            hooks = adapter.Hooks(self.model, None, backward=self.options["backward"], params=self.options["params"],
                                  path_filter=path_filter, forcer=self.forcer)
        except ValueError as exc:
            raise LayerdiffError(str(exc)) from None
        meta["window"] = hooks.path_filter.window_paths
        ranks = getattr(adapter, "distributed", lambda: None)()
        if ranks is not None and self.one_process:
            raise LayerdiffError(f"bisect replays the candidate in one process; this one runs as rank {ranks['rank']} "
                                 f"of {ranks['world_size']}: replay a single-process build of it against the "
                                 "reference, or align the multi-rank run (layerdiff align REF RUN)")
        meta["distributed"] = ranks
        writer = TraceWriter(self._file_path(ranks), meta, overwrite=self.overwrite,
                             compression=self.options["compression"], flush_interval=self.options["flush_interval"],
                             write_behind=int(self.options["write_behind"] * 2**20))
        self.session = hooks.session = TraceSession(writer, adapter.TENSORS, self.options["mode"])
        self._hooks = hooks
        hooks.install()
        return self

    def _file_path(self, ranks: dict | None) -> str:
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

    def flush(self):
        self.session.writer.flush()

    def __exit__(self, exc_type, exc, tb):
        self._hooks.remove()
        self.session.close(exc)
        return False


def trace(model, path, **options) -> Tracer:
    """Trace every module call of ``model`` (forward and, by default, backward) into the HDF5 file ``path``.

    Options: mode="full"|"stats", backward=True, include/exclude (module-path regexes), layers=(start, end)
    (only blocks start..end-1 of the model's main module list: the second pass of two-pass tracing), overwrite=False,
    compression=None|"gzip"|"lzf", flush_interval=1.0 (seconds; 0 flushes after every record),
    params=True (parameter values and gradients), meta={...} (your own notes, stored in the trace),
    write_behind=MB (full mode: tensor bytes are written by a thread of their own through a ring of this size,
    256 by default, so the disk works while the model computes; 0 writes every record before the step goes on,
    for hunting a crash that kills the process outright).
    """
    return Tracer(model, path, **options)


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
