"""A warm interpreter for the tests' CLI runs (``conftest.run_cli``): it imports torch, transformers' Llama and
layerdiff's CLI once, then forks one child per request, and the child runs ``layerdiff.cli.main`` as
``python -m layerdiff`` would, in a process of its own (its working directory, environment, stdin, stdout and
stderr set as asked; exit code, traceback and ``atexit`` handlers as the interpreter's).

Why: a fresh interpreter spent ~4.5 s of every torch CLI run importing torch and transformers (a third of the
suite's CPU time). It is safe to fork here only because this process never computes with torch: OpenMP's worker
threads start at the first parallel operation, and a child forked after that hangs in its own first one.

Protocol: one JSON request per line on stdin ({argv, cwd, env, stdout, stderr, timeout}), one JSON reply per line
on stdout ({codes: [code]} or {timeout: true}); "ready" first.

Scripts too (``conftest.launch``, ``conftest.run_scripts``): a request {procs: [{script, args, cwd, env, stdout,
stderr}], timeout} forks one child per entry, all at once, each running its script as ``python SCRIPT ARGS`` would
(``__main__``, its folder first on ``sys.path``); the reply is {codes: [...]} once all have exited. The ranks of a
launch are such children, each given the environment torchrun gives a rank; when one fails, the others are given
``GRACE`` seconds, then killed, as torchrun stops a job whose rank failed. Started with ``--preload MODULE ...``, the
interpreter imports those too (Megatron-core: 3 s more, once, instead of 7 s in every rank).
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch  # noqa: F401  imported, never computed with (see above)
import transformers.models.llama.modeling_llama  # noqa: F401

import layerdiff.cli


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter makes of a ``SystemExit``: None is 0, an int itself, anything else printed and 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


GRACE = 10.0  # seconds the other children of a request are given after one failed


def _child(request: dict) -> None:
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))  # as read at start
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        script = request.get("script")
        if script is None:  # a CLI run
            sys.path[0] = request["cwd"]  # as ``python -m`` puts it first (here it was this file's directory)
            sys.argv = [os.path.join(os.path.dirname(layerdiff.cli.__file__), "__main__.py"), *request["argv"]]
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as ``python SCRIPT`` puts it first
            sys.argv = [script, *request["args"]]
        try:
            if script is None:
                code = layerdiff.cli.main()
            else:
                runpy.run_path(script, run_name="__main__")
                code = None
            code = 0 if code is None else code
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # as the interpreter: the traceback on stderr, exit status 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if isinstance(code, int) else 1)


def _wait_all(pids: list[int], timeout: float) -> dict:
    """Every child's exit code, once all have exited. When one fails, the others still running are killed after
    ``GRACE`` seconds (their codes say so); at the deadline all are killed and the reply is {timeout: true}."""
    end = time.monotonic() + timeout
    deadline = end
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                    if codes[pid] != 0:
                        deadline = min(deadline, time.monotonic() + GRACE)
        if len(codes) < len(pids) and time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if deadline == end:
                return {"timeout": True}
        time.sleep(0.005)
    return {"codes": [codes[pid] for pid in pids]}


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--preload"]:
        for module in args[1:]:
            importlib.import_module(module)  # imported, never computed with
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for entry in request.get("procs", [request]):
            pid = os.fork()
            if pid == 0:
                _child(entry)
            pids.append(pid)
        print(json.dumps(_wait_all(pids, request["timeout"])), flush=True)


if __name__ == "__main__":
    main()
