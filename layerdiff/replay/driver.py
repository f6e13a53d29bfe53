"""``layerdiff bisect``: run the candidate again on the reference's numbers to confirm where it goes wrong.

Two strategies, both resumable (a state file in the work directory records every finished run):

* replay (default): one free run of the candidate, traced and aligned with the reference (mapping and how each
  module amplifies the error it receives), then one run with the reference's values forced in at every module
  boundary, forward and backward (``replay.segments``): every difference left is a module's own error.
* search (``--search``): for candidates too expensive to replay module by module. A baseline run, then runs that
  each splice the reference's activation into one block boundary (a decoder layer's input) and check whether the
  candidate's last block recovers: log2(N) runs for N blocks. Only three blocks are
  hooked per run (the first, the spliced one, the last), plus the model itself as statistics.

Each run builds the candidate afresh (``runner.build``): a step that trains must not start from the weights a
previous run updated.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from layerdiff import runner
from layerdiff.capture.options import TraceOptions
from layerdiff.compare.measure import measure, module_mapping
from layerdiff.compare.spec import Comparison
from layerdiff.errors import LayerdiffError
from layerdiff.files import write_atomically
from layerdiff.judge.evaluate import align
from layerdiff.match.mapping import ModuleMapping
from layerdiff.match.microbatches import joined_pair
from layerdiff.match.sides import TraceSide
from layerdiff.replay.forcer import Forcer
from layerdiff.replay.search import find_blocks, next_splice, observe
from layerdiff.replay.segments import evaluate_replay
from layerdiff.runs.ranks import open_run, rank_files
from layerdiff.tracefile.reader import open_trace
from layerdiff.tracefile.records import CallRecord
from layerdiff.tracing import Tracer

STATE_VERSION = 1


class Workdir:
    """The runs' traces and ``state.json``: what has been done for which command, so a rerun resumes."""

    def __init__(self, path, command: dict, restart: bool = False):
        self.path = Path(path)
        self.state_file = self.path / "state.json"
        self.command = command
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LayerdiffError(f"cannot use {self.path} as the work directory: {exc.strerror or exc}") from None
        self.state: dict[str, Any] = {"version": STATE_VERSION, "command": command, "runs": {}}
        if self.state_file.exists() and not restart:
            try:
                saved = json.loads(self.state_file.read_text())
            except (OSError, ValueError):
                raise LayerdiffError(f"{self.state_file}: not a bisect state file; pass --restart to start over "
                                     "or choose another --workdir") from None
            if not isinstance(saved, dict) or saved.get("command") != command:
                raise LayerdiffError(f"{self.path} holds a bisect of another command; pass --restart to start "
                                     "over or choose another --workdir")
            self.state = saved

    def done(self, name: str) -> dict | None:
        run = self.state["runs"].get(name)
        if run is None or run.get("status") != "done":
            return None
        if run.get("trace") and not (self.path / run["trace"]).is_file():
            return None
        return run

    def record(self, name: str, run: dict):
        self.state["runs"][name] = {**run, "status": "done"}
        write_atomically(self.state_file, json.dumps(self.state, indent=1, default=str), overwrite=True)

    def trace_path(self, name: str) -> Path:
        return self.path / f"{name}.h5"


def default_workdir(reference, command: dict) -> str:
    """``REF.bisect`` for the first command on a reference; a second candidate (another target, other
    arguments) gets its own directory next to it instead of being refused: ``REF.bisect-<hash>``."""
    first = Path(f"{Path(reference).name}.bisect")
    state = first / "state.json"
    if not state.exists():
        return str(first)
    try:
        if json.loads(state.read_text()).get("command") == command:
            return str(first)
    except (OSError, ValueError):
        return str(first)  # a damaged state: Workdir says so
    digest = hashlib.sha256(json.dumps(command, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{first}-{digest}"


def reference_identity(path) -> dict:
    """Enough to notice that the reference changed between an interrupted bisect and its resumption."""
    files = rank_files(path) or [Path(path)]  # a multi-rank run: every rank's trace
    digest, size = hashlib.sha256(), 0
    for file in files:
        size += Path(file).stat().st_size
        with open(file, "rb") as f:
            digest.update(f.read(1 << 20))
    return {"path": str(Path(path).resolve()), "size": size, "head_sha256": digest.hexdigest()[:16]}


def run_candidate(target: str, kwargs: dict, path: Path, *, forcer=None, backward=True, include=None,
                  exclude=None, params=True, layers=None, mode="full", strict_filters=True, ops=False) -> dict:
    """Build the candidate, run one step under the tracer, close the trace. A step that raises is a result
    (the trace records where), not an error of bisect."""
    model, step, meta = runner.build(target, kwargs)
    options = TraceOptions(mode=mode, backward=backward, include=include, exclude=exclude, params=params,
                           layers=layers, one_process=True, strict_filters=strict_filters, overwrite=True, ops=ops,
                           meta={"target": target, "bisect": True, **(meta or {})})
    tracer = Tracer(model, path, options, forcer=forcer)
    with _Guard(tracer) as guard:
        step()
    return {"trace": path.name, "raised": guard.error}


class _Guard:
    """Enter the tracer; on exit close it (recording the failure) and swallow the step's exception."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.error = None

    def __enter__(self):
        self.tracer.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.tracer.__exit__(exc_type, exc, tb)
        if exc is not None and isinstance(exc, Exception):
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return True
        return False


def check_reference(path):
    """Fail early (one line, nothing created) when the reference cannot drive a bisect."""
    _reference(path).close()


def summary_line(result: dict) -> str:
    if result["kind"] == "search":
        block = f"{result['block']}: " if result.get("block") else ""
        return f"{result['verdict']}: {block}{result['answer']['description']} ({result['splice_runs']} splice runs)"
    parts = []
    for phase in ("forward", "backward"):
        culprit = result[phase]["culprit"]
        parts.append(f"{phase} {culprit['description'] if culprit else 'no own error'}")
    return f"{result['verdict']}: " + "; ".join(parts)


def _reference(path):
    """Open the reference and check it can drive a replay: full-mode tensors of step 0 (a multi-rank run is read
    merged: the candidate is fed the full tensors)."""
    reader = open_run(path)
    calls = [r for r in reader.records if isinstance(r, CallRecord) and r.step == 0]
    if not calls:
        reader.close()
        raise LayerdiffError(f"{path}: holds no module calls to replay")
    if not any(t.offset is not None for r in calls for t in r.tensors):
        reader.close()
        raise LayerdiffError(f"{path}: traced in stats mode; bisect needs the reference's tensors: trace the "
                             "suspect window in full mode (layerdiff trace ... --layers START:END)")
    return reader


def _reference_options(reader) -> dict:
    options = reader.meta.get("options") or {}
    ops = options.get("ops") or False  # the candidate records operations where the reference did
    return {"backward": bool(options.get("backward", True)), "include": options.get("include"),
            "exclude": options.get("exclude"), "params": bool(options.get("params", True)),
            "layers": options.get("layers"), "ops": ops if isinstance(ops, bool) else list(ops)}


def replay(reference, target: str, kwargs: dict, workdir: Workdir, how: Comparison, *, include=None, exclude=None,
           progress=None) -> dict:
    """Free run + forced run of the candidate; the replay result (see ``evaluate_replay``)."""
    with _reference(reference) as ref:
        _expect(progress, 2)
        options = _reference_options(ref)
        traced = dict(backward=options["backward"], params=options["params"], layers=options["layers"],
                      ops=options["ops"], include=options["include"] if include is None else include,
                      exclude=options["exclude"] if exclude is None else exclude)
        free = _run_once(workdir, "free", f"free run of {target}", progress,
                         lambda: run_candidate(target, kwargs, workdir.trace_path("free"), **traced))
        with open_trace(workdir.trace_path("free")) as free_trace:
            free_report = align(ref, free_trace, how)
            mapping = module_mapping(ref, free_trace, how)

            # a reference whose steps ran as microbatches (a pipeline schedule) forces its joined tensors into a
            # candidate that takes the whole batch at once (each microbatch's did not fit its shapes)
            source, _ = joined_pair(ref, free_trace)

            def forced_run():  # the free run says which module is which, fused ones and layouts included
                forcer = Forcer(source, how, backward=options["backward"], mapping=mapping,
                                side_b=TraceSide(free_trace.records, free_trace.meta, how.rules, free_trace))
                run = run_candidate(target, kwargs, workdir.trace_path("replay"), forcer=forcer, **traced)
                return {**run, "forcing": {"forced_tensors": forcer.forced, "not_forced": forcer.unforced}}

            forced = _run_once(workdir, "replay", f"replay of {target} on the reference's values", progress,
                               forced_run)
        with open_trace(workdir.trace_path("replay")) as forced_trace:
            measured = measure(ref, forced_trace, how)
    result = evaluate_replay(measured, how.policy, free_report, forced.get("forcing"))
    result["runs"] = {"free": free, "replay": forced}
    result["workdir"] = str(workdir.path)
    return result


def _run_once(workdir: Workdir, name: str, label: str, progress, make) -> dict:
    """A finished run from the state file, or run it now and record it."""
    done = workdir.done(name)
    if done is not None:
        _advance(progress, f"{label}: reused from {workdir.state_file}")
        return done
    _advance(progress, label, start=True)
    run = make()
    workdir.record(name, run)
    _advance(progress, f"{label}: done" + (f" (the candidate raised {run['raised']})" if run.get("raised") else ""))
    done = workdir.done(name)
    if done is None:  # its trace is gone already
        raise LayerdiffError(f"{workdir.path}: the {name} run left no trace")
    return done


def search(reference, target: str, kwargs: dict, workdir: Workdir, how: Comparison, *, container: str | None = None,
           progress=None) -> dict:
    """Binary search over the reference's top-level blocks by splicing its activations into the candidate."""
    with _reference(reference) as ref:
        parent, blocks = find_blocks(ref.records, container)
        if len(blocks) < 2:
            where = f"under {container!r}" if container else "(a module list with numbered children)"
            raise LayerdiffError(f"{reference}: found no blocks to search {where}; name them with --blocks PATH")
        _expect(progress, 1 + math.ceil(math.log2(len(blocks))))
        names = _BlockNames(ref, how)
        runs: list[dict] = []
        while True:
            spliced, answer = next_splice(len(blocks), runs) if runs else (None, None)
            if answer is not None:
                break
            name = "baseline" if spliced is None else f"splice_{spliced}"
            label = "baseline run (nothing spliced)" if spliced is None else \
                f"splice the reference's input into {blocks[spliced]}"

            def splice_run(spliced=spliced, name=name):
                # the model itself is recorded too, with statistics only (its logits can outweigh every block)
                watched = [blocks[0], blocks[-1]] + ([blocks[spliced]] if spliced is not None else [])
                forcer = None if spliced is None else Forcer(ref, how, backward=False, where=_splice_at(blocks[spliced]),
                                                             **names.forcing())
                run = run_candidate(target, kwargs, workdir.trace_path(name), forcer=forcer, backward=False,
                                    include=names.include(watched), params=False, strict_filters=False)
                if spliced is None and not names.found(workdir.trace_path(name), watched):
                    names.learn(target, kwargs, workdir, progress)  # a port: its own names for the blocks
                    run = run_candidate(target, kwargs, workdir.trace_path(name), backward=False,
                                        include=names.include(watched), params=False, strict_filters=False)
                with open_trace(workdir.trace_path(name)) as cand:
                    measured = measure(ref, cand, replace(how, auto_map=False), mapping=names.mapping)
                return {**run, "ported": names.mapping is not None,
                        "observation": {**observe(measured, how.policy, blocks, spliced), "raised": run["raised"]}}

            done = _run_once(workdir, name, label, progress, splice_run)
            if done.get("ported") and names.mapping is None:  # resumed: the port's names come from the state
                names.learn(target, kwargs, workdir, progress)
            runs.append(done["observation"])
    block = blocks[answer["block"]] if answer.get("where") == "block" else None
    return {"kind": "search", "a": {"path": str(reference)}, "b": {"target": target, "target_args": kwargs},
            "container": parent, "blocks": blocks, "runs": runs,
            "splice_runs": sum(1 for r in runs if r["spliced"] is not None),
            "expected_runs": math.ceil(math.log2(len(blocks))), "answer": answer, "block": block,
            "block_b": names.own_name(block) if block else None,
            "tolerances": how.policy.describe(), "workdir": str(workdir.path),
            "verdict": "aligned" if answer["where"] == "none" else "divergent"}


class _BlockNames:
    """The candidate's names for the reference's blocks. When the candidate is a port (``decoder.layers.3`` for
    ``model.layers.3``), one cheap run (statistics only, forward, every module) gives the module mapping; the
    splice runs then hook the candidate's own blocks and force through that mapping."""

    def __init__(self, ref, how: Comparison):
        self.ref, self.how = ref, how
        self.mapping: ModuleMapping | None = None
        self.side_b: TraceSide | None = None

    def found(self, trace_path: Path, blocks_a) -> bool:
        with open_trace(trace_path) as trace:
            paths = {self.how.rename(r.path) for r in trace.records if isinstance(r, CallRecord)}
        return any(b in paths for b in blocks_a)

    def learn(self, target, kwargs, workdir: Workdir, progress):
        _run_once(workdir, "names", f"names of {target}'s modules (statistics only)", progress,
                  lambda: run_candidate(target, kwargs, workdir.trace_path("names"), backward=False, mode="stats"))
        with open_trace(workdir.trace_path("names")) as trace:
            self.mapping = module_mapping(self.ref, trace, replace(self.how, auto_map=True))
            self.side_b = TraceSide(trace.records, trace.meta, self.how.rules)

    def include(self, blocks_a) -> list:
        """Regexes for the candidate's include filter: its own names of the reference's blocks."""
        out = []
        for block in blocks_a:
            match = self.mapping.for_a(block) if self.mapping is not None else None
            out += [f"^{re.escape(b)}$" for b in (match.b if match else (block,))]
        return out

    def forcing(self) -> dict:
        return {"mapping": self.mapping, "side_b": self.side_b} if self.mapping is not None else {}

    def own_name(self, block_a: str) -> str:
        match = self.mapping.for_a(block_a) if self.mapping is not None else None
        return match.b[0] if match else block_a


def _splice_at(block: str):
    return lambda path, role: path == block and role == "input"


def _expect(progress, runs: int):
    if progress is not None:
        progress.expect(runs)


def _advance(progress, message: str, start: bool = False):
    if progress is not None:
        progress(message, start)
