"""A warm interpreter for the processes the tests start (``conftest.run_cli``, ``conftest.launch``,
``conftest.run_scripts``, ``conftest.run_python``): it imports one framework and layerdiff once, then forks one child
per process asked for, and the child runs ``layerdiff.cli.main`` as ``python -m layerdiff`` would, a script as
``python SCRIPT ARGS`` would (``__main__``, its folder first on ``sys.path``), or code as ``python -c CODE ARGS``
would: in a process of its own, its working directory, environment, stdin, stdout and stderr set as asked; exit
code, traceback and ``atexit`` handlers as the interpreter's.

Why: a fresh interpreter spends seconds importing a framework (torch with transformers or Megatron-core: 7 s of CPU;
MindSpore 2.7 s; Paddle 1.8 s), and the suite starts hundreds of such processes. It is safe to fork here only because
this process never computes with the framework: OpenMP's worker threads start at the first parallel operation, and
a child forked after that hangs in its own first one.

One interpreter per framework serves the whole test session: every test worker connects to its Unix socket (the
first to need it starts it, under a lock). Each connection is served by a process forked for it, so the workers'
requests run side by side. It exits when the session's owner process (pytest's controller) is gone.

Protocol, per connection: one JSON request per line ({procs: [{argv | script+args | code+args, cwd, env, stdout,
stderr}], timeout}), one JSON reply per line: {codes: [...]} once all its children have exited, or {timeout:
true}. The children of one request are forked at once (the ranks of a launch); when one fails, the others are given
``GRACE`` seconds, then killed, as torchrun stops a job whose rank failed.

Started as ``cli_zygote.py SOCKET OWNER_PID MODULE...``: it imports the modules and layerdiff's framework-free core,
listens, prints "ready".
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback


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
        script, source = request.get("script"), request.get("code")
        if source is not None:  # python -c
            sys.path[0] = ""  # as ``python -c`` puts it first: the working directory
            sys.argv = ["-c", *request["args"]]
        elif script is not None:
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as ``python SCRIPT`` puts it first
            sys.argv = [script, *request["args"]]
        else:  # a CLI run
            import layerdiff.cli

            sys.path[0] = request["cwd"]  # as ``python -m`` puts it first (here it was this file's directory)
            sys.argv = [os.path.join(os.path.dirname(layerdiff.cli.__file__), "__main__.py"), *request["argv"]]
        try:
            if source is not None:
                exec(compile(source, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
                code = None
            elif script is not None:
                runpy.run_path(script, run_name="__main__")
                code = None
            else:
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


def _serve(conn: socket.socket) -> None:
    """One test worker's connection: its requests, one at a time, until it closes."""
    stream = conn.makefile("rw")
    for line in stream:
        request = json.loads(line)
        pids = []
        for entry in request["procs"]:
            pid = os.fork()
            if pid == 0:
                stream.close()
                conn.close()
                _child(entry)
            pids.append(pid)
        stream.write(json.dumps(_wait_all(pids, request["timeout"])) + "\n")
        stream.flush()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _import_layerdiff() -> None:
    """Every module of layerdiff's framework-free core (adapters and recipes are in the modules asked for): a
    forked CLI run spent 0.25 s importing the ones its command needs, more than the run itself (a refused input)."""
    import pkgutil

    import layerdiff

    for info in pkgutil.walk_packages(layerdiff.__path__, "layerdiff."):
        if info.name.endswith("__main__") or info.name.startswith(
                ("layerdiff.adapters.", "layerdiff.recipes", "layerdiff.compare.dask_pool")):  # Dask: when asked
            continue
        importlib.import_module(info.name)


def main() -> None:
    path, owner, modules = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    for module in modules:
        try:
            importlib.import_module(module)  # imported, never computed with
        except ImportError:  # (transformers missing, say): a child imports what it needs itself
            pass
    _import_layerdiff()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the worker that started this one may exit first: nothing more is written to its pipe
        os.dup2(devnull, fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # connection servers are reaped as they exit
    try:
        while _alive(owner):
            ready, _, _ = select.select([listener], [], [], 1.0)
            if not ready:
                continue
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this one waits for its children
                try:
                    _serve(conn)
                finally:
                    os._exit(0)
            conn.close()
    finally:  # the session is over: its socket, lock and folder go
        folder, name = os.path.split(path)
        for leftover in (path, os.path.join(folder, name.replace(".sock", ".lock"))):
            try:
                os.unlink(leftover)
            except OSError:
                pass
        try:
            os.rmdir(folder)
        except OSError:  # another interpreter's files are still there
            pass


if __name__ == "__main__":
    main()
