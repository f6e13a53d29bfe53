"""A warm interpreter for the tests' CLI runs (``conftest.run_cli``): it imports torch, transformers' Llama and
layerdiff's CLI once, then forks one child per request, and the child runs ``layerdiff.cli.main`` as
``python -m layerdiff`` would, in a process of its own (its working directory, environment, stdin, stdout and
stderr set as asked; exit code, traceback and ``atexit`` handlers as the interpreter's).

Why: a fresh interpreter spent ~4.5 s of every torch CLI run importing torch and transformers (a third of the
suite's CPU time). It is safe to fork here only because this process never computes with torch: OpenMP's worker
threads start at the first parallel operation, and a child forked after that hangs in its own first one.

Protocol: one JSON request per line on stdin ({argv, cwd, env, stdout, stderr, timeout}), one JSON reply per line
on stdout ({code} or {timeout: true}); "ready" first.
"""
from __future__ import annotations

import atexit
import json
import os
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


def _child(request: dict) -> None:
    code = 1
    try:
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as ``python -m`` puts it first (here it was this file's directory)
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        sys.argv = [os.path.join(os.path.dirname(layerdiff.cli.__file__), "__main__.py"), *request["argv"]]
        try:
            code = layerdiff.cli.main()
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


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"code": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.005)


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps(_wait(pid, request["timeout"])), flush=True)


if __name__ == "__main__":
    main()
