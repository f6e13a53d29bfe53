"""Bad input through the real CLI: exit 2, exactly one stderr line starting with "layerdiff", no traceback,
and nothing on disk touched (inputs keep their bytes and mtime, no output file appears or is overwritten).

Every case runs the CLI in a process of its own (``conftest.run_cli``). Real traces come from the torch_llama recipe and from
a small nn.Sequential MLP target file, made once per session.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

import conftest

pytest.importorskip("torch")  # every case runs the CLI, on torch models

pytestmark = [pytest.mark.torch]

MLP_TARGET = '''
import torch

def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    return {"model": model, "step": step}
'''

WRONG_TARGETS = '''
def returns_int():
    return 42

def returns_none_model():
    return {"model": None, "step": lambda: None}

def returns_three():
    import torch
    return (torch.nn.Linear(2, 2), lambda: None, "extra")

def step_not_callable():
    import torch
    return {"model": torch.nn.Linear(2, 2), "step": 5}

def model_not_a_module():
    return {"model": object(), "step": lambda: None}

not_a_function = 7
'''

NO_BUILD_TARGET = '''
def something_else():
    return None
'''


def run_cli(*args, cwd):
    """The CLI in a process of its own (``conftest.run_cli``), which must leave no ``__pycache__`` beside a target
    file it imports."""
    code, out, err = conftest.run_cli(*args, cwd=cwd, env={"PYTHONDONTWRITEBYTECODE": "1"})
    return subprocess.CompletedProcess(["layerdiff", *map(str, args)], code, out, err)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(*roots) -> dict:
    """Every file and directory under roots: kind, size, mtime and content hash (dir mtime catches temp files)."""
    out = {}
    for root in roots:
        root = Path(root)
        for p in [root, *sorted(root.rglob("*"))]:
            st = p.lstat()
            if p.is_file():
                out[str(p)] = ("file", st.st_size, st.st_mtime_ns, _sha(p))
            else:
                out[str(p)] = ("dir", st.st_mtime_ns)
    return out


def _describe(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def assert_one_line_error(proc):
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, _describe(proc)
    assert proc.returncode == 2, _describe(proc)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"stderr must be exactly one line\n{_describe(proc)}"
    assert lines[0].strip(), _describe(proc)
    assert lines[0].startswith("layerdiff"), _describe(proc)


def check_bad_input(args, cwd, watch):
    """Run the CLI and assert the bad-input contract; nothing under ``watch`` may change."""
    before = snapshot(*watch)
    proc = run_cli(*args, cwd=cwd)
    assert_one_line_error(proc)
    after = snapshot(*watch)
    assert after == before, f"files changed on disk:\n{_diff(before, after)}\n{_describe(proc)}"
    return proc


def _diff(before, after):
    lines = []
    for k in sorted(set(before) | set(after)):
        if before.get(k) != after.get(k):
            lines.append(f"  {k}: {before.get(k)} -> {after.get(k)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# fixtures: real traces, made once
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def bad_input_traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input_traces")
    (root / "mlp_target.py").write_text(MLP_TARGET)
    llama, mlp = root / "llama.h5", root / "mlp.h5"
    for target, out in (("torch_llama", llama), ("mlp_target.py", mlp)):
        proc = run_cli("trace", target, "-o", out.name, cwd=root)
        assert proc.returncode == 0, _describe(proc)
        assert out.is_file() and out.stat().st_size > 0
    return {"dir": root, "llama": llama, "mlp": mlp}


@pytest.fixture
def work(tmp_path, bad_input_traces):
    """A fresh working directory with a private copy of the recipe trace, and the dirs to watch."""
    trace = tmp_path / "trace.h5"
    shutil.copy2(bad_input_traces["llama"], trace)
    return {"dir": tmp_path, "trace": trace, "llama": bad_input_traces["llama"], "mlp": bad_input_traces["mlp"],
            "watch": [tmp_path, bad_input_traces["dir"]]}


# ---------------------------------------------------------------------------------------------------------
# align: inputs that are not traces
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["a", "b"])
def test_align_missing_file(work, side):
    args = ["align", "missing.h5", work["trace"]] if side == "a" else ["align", work["trace"], "missing.h5"]
    proc = check_bad_input(args, work["dir"], work["watch"])
    assert "missing.h5" in proc.stderr
    assert not (work["dir"] / "missing.h5").exists()


def test_align_directory(work):
    (work["dir"] / "adir").mkdir()
    proc = check_bad_input(["align", "adir", work["trace"]], work["dir"], work["watch"])
    assert "adir" in proc.stderr


def test_align_empty_file(work):
    (work["dir"] / "empty.h5").write_bytes(b"")
    check_bad_input(["align", work["trace"], "empty.h5"], work["dir"], work["watch"])
    assert (work["dir"] / "empty.h5").read_bytes() == b""


def test_align_random_bytes(work):
    (work["dir"] / "random.h5").write_bytes(random.Random(0).randbytes(10_000))
    check_bad_input(["align", "random.h5", work["trace"]], work["dir"], work["watch"])


def test_align_text_file(work):
    (work["dir"] / "notes.txt").write_text("this is not a trace\nsecond line\n")
    check_bad_input(["align", work["trace"], "notes.txt"], work["dir"], work["watch"])


def test_align_hdf5_that_is_not_a_trace(work):
    import h5py

    with h5py.File(work["dir"] / "other.h5", "w") as f:
        f["x"] = [1.0, 2.0, 3.0]
        f.attrs["format"] = "something-else"
    proc = check_bad_input(["align", "other.h5", work["trace"]], work["dir"], work["watch"])
    assert "other.h5" in proc.stderr


def test_align_hdf5_with_index_and_data_but_no_format_attr(work):
    import h5py

    with h5py.File(work["dir"] / "lookalike.h5", "w") as f:
        f["index"] = [1, 2, 3]
        f["data"] = [0, 0]
    check_bad_input(["align", work["trace"], "lookalike.h5"], work["dir"], work["watch"])


@pytest.mark.parametrize("keep", ["half", "1000"])
def test_align_truncated_trace(work, keep):
    data = work["trace"].read_bytes()
    n = len(data) // 2 if keep == "half" else 1000
    (work["dir"] / "cut.h5").write_bytes(data[:n])
    check_bad_input(["align", "cut.h5", work["trace"]], work["dir"], work["watch"])
    check_bad_input(["align", work["trace"], "cut.h5"], work["dir"], work["watch"])


def _index_location(path: Path):
    """(byte offset in the file, length) of the trace's /index bytes (one chunk for a small trace)."""
    import h5py

    with h5py.File(path, "r") as f:
        ds = f["index"]
        info = ds.id.get_chunk_info(0)
        return info.byte_offset, ds.shape[0]


def _garble(path: Path, case: str):
    data = bytearray(path.read_bytes())
    rng = random.Random(1234)
    if case == "file_middle":  # the middle of the file: tensor bytes
        at, junk = len(data) // 2, rng.randbytes(4096)
    elif case == "index_middle":  # the middle of the JSON-lines record index
        start, length = _index_location(path)
        at, junk = start + length // 2, rng.randbytes(512)
    elif case == "index_non_record_line":  # a line of the index replaced by valid JSON that is no record
        start, length = _index_location(path)
        at = bytes(data).index(b"\n", start + length // 2) + 1
        junk = b"[1]\n"
    elif case == "hdf5_metadata":  # HDF5 object headers / heap near the start of the file
        at, junk = 2048, rng.randbytes(64)
    else:
        raise AssertionError(case)
    data[at:at + len(junk)] = junk
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", ["file_middle", "index_middle", "index_non_record_line", "hdf5_metadata"])
def test_align_garbage_in_the_middle(work, case):
    """Garbled bytes: a one-line exit 2, or a normal report with exit 0/1, or 3 (aligned on what was readable,
    with the warning that the trace is damaged, naming where). Never a traceback."""
    garbled = work["dir"] / "garbled.h5"
    shutil.copy2(work["trace"], garbled)
    _garble(garbled, case)
    before = snapshot(*work["watch"])
    proc = run_cli("align", "garbled.h5", work["trace"], cwd=work["dir"])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, _describe(proc)
    assert proc.returncode in (0, 1, 2, 3), _describe(proc)
    if proc.returncode == 2:
        assert_one_line_error(proc)
    else:  # a report: both traces named and a verdict that matches the exit code
        assert "verdict: " in proc.stdout, _describe(proc)
        expected = "divergent" if proc.returncode == 1 else "aligned"
        if proc.returncode == 3:
            assert "WARNING: A (garbled.h5) is damaged" in proc.stdout, _describe(proc)
        if case != "hdf5_metadata":  # every garbled byte of the index or the data is covered by a checksum
            assert proc.returncode != 0 and "is damaged" in proc.stdout, _describe(proc)
        assert f"verdict: {expected}" in proc.stdout, _describe(proc)
        assert "garbled.h5" in proc.stdout, _describe(proc)
    assert snapshot(*work["watch"]) == before


def test_align_unrelated_models(work):
    proc = check_bad_input(["align", work["trace"], work["mlp"]], work["dir"], work["watch"])
    assert "--map" in proc.stderr or "share no" in proc.stderr
    check_bad_input(["align", work["mlp"], work["trace"]], work["dir"], work["watch"])


def test_align_json_refuses_existing_file(work):
    existing = work["dir"] / "report.json"
    existing.write_text('{"mine": "keep me"}\n')
    proc = check_bad_input(["align", work["trace"], work["trace"], "--json", "report.json"], work["dir"],
                           work["watch"])
    assert "report.json" in proc.stderr
    assert existing.read_text() == '{"mine": "keep me"}\n'


# ---------------------------------------------------------------------------------------------------------
# align: bad flags (the traces are fine; only the flag is wrong)
# ---------------------------------------------------------------------------------------------------------
BAD_FLAGS = {
    "atol_not_a_number": ["--atol", "abc"],
    "rtol_not_a_number": ["--rtol", "1e-3x"],
    "atol_negative": ["--atol", "-1"],
    "atol_nan": ["--atol", "nan"],          # a NaN tolerance would make every comparison pass
    "cos_above_one": ["--cos", "2"],
    "cos_below_minus_one": ["--cos", "-1.5"],
    "tol_without_colon": ["--tol", "nocolon"],
    "tol_bad_key": ["--tol", "model:foo=1"],
    "tol_bad_value": ["--tol", "model:atol=abc"],
    "tol_bad_regex": ["--tol", "(:atol=1"],
    "tol_negative_atol": ["--tol", "model:atol=-1"],  # --atol -1 is refused; a rule's atol=-1 must be too
    "unknown_flag": ["--bogus"],
    "map_without_equals": ["--map", "x"],
    "map_bad_regex": ["--map", "(=x"],
    "json_without_value": ["--json"],
    "workers_zero": ["--workers", "0"],
    "workers_not_a_number": ["--workers", "two"],
    "scheduler_not_an_address": ["--scheduler", "not an address"],
    "scheduler_empty": ["--scheduler", ""],
    "scheduler_without_port": ["--scheduler", "tcp://10.0.0.5"],
    "scheduler_address_with_workers": ["--scheduler", "tcp://127.0.0.1:8786", "--workers", "2"],  # whose workers?
}


@pytest.mark.parametrize("flags", BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_align_bad_flags(work, flags):
    check_bad_input(["align", work["trace"], work["trace"], *flags], work["dir"], work["watch"])


def test_align_missing_positional(work):
    check_bad_input(["align", work["trace"]], work["dir"], work["watch"])


def test_unknown_command(work):
    check_bad_input(["frobnicate", work["trace"]], work["dir"], work["watch"])


# ---------------------------------------------------------------------------------------------------------
# trace
# ---------------------------------------------------------------------------------------------------------
def test_trace_refuses_existing_output(work):
    existing = work["dir"] / "existing.h5"
    existing.write_bytes(b"precious bytes that are not a trace")
    proc = check_bad_input(["trace", "torch_llama", "-o", "existing.h5"], work["dir"], work["watch"])
    assert "existing.h5" in proc.stderr
    assert existing.read_bytes() == b"precious bytes that are not a trace"


def test_trace_refuses_existing_trace_output(work):
    check_bad_input(["trace", "torch_llama", "-o", work["trace"]], work["dir"], work["watch"])


@pytest.mark.parametrize("target", ["missing_model.py", "missing_model.py:build", "./sub/missing.py:make"])
def test_trace_missing_target_file(work, target):
    proc = check_bad_input(["trace", target, "-o", "out.h5"], work["dir"], work["watch"])
    assert "missing" in proc.stderr
    assert not (work["dir"] / "out.h5").exists()


def test_trace_unknown_recipe_or_module(work):
    check_bad_input(["trace", "no_such_recipe_or_module_xyz", "-o", "out.h5"], work["dir"], work["watch"])


@pytest.mark.parametrize("command", ["trace", "bisect"])
def test_a_directory_given_as_the_code_to_run(work, command):
    """A run's directory where a target belongs (``bisect ref.h5 RUN``) is said to be one, not read as a package."""
    (work["dir"] / "a_run").mkdir()
    args = ["trace", "a_run", "-o", "out.h5"] if command == "trace" else ["bisect", str(work["trace"]), "a_run"]
    proc = check_bad_input(args, work["dir"], work["watch"])
    assert "'a_run' is a directory (a run of traces?), not code to run" in proc.stderr


@pytest.mark.parametrize("target", ["nobuild.py", "nobuild.py:build", "nobuild.py:missing_function"])
def test_trace_target_without_the_function(work, target):
    (work["dir"] / "nobuild.py").write_text(NO_BUILD_TARGET)
    proc = check_bad_input(["trace", target, "-o", "out.h5"], work["dir"], work["watch"])
    assert ("build" if target != "nobuild.py:missing_function" else "missing_function") in proc.stderr


@pytest.mark.parametrize("function", ["returns_int", "returns_none_model", "returns_three", "step_not_callable",
                                      "model_not_a_module", "not_a_function"])
def test_trace_target_returning_something_wrong(work, function):
    (work["dir"] / "wrong.py").write_text(WRONG_TARGETS)
    check_bad_input(["trace", f"wrong.py:{function}", "-o", "out.h5"], work["dir"], work["watch"])


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--steps", "-3"], ["--flush-interval", "-1"],
                                   ["--mode", "bogus"], ["--arg", "noequals"], ["--arg", "no_such_kwarg=1"]],
                         ids=["steps0", "steps_negative", "flush_negative", "bad_mode", "arg_no_equals",
                              "arg_unknown_kwarg"])
def test_trace_bad_flags(work, flags):
    check_bad_input(["trace", "torch_llama", "-o", "out.h5", *flags], work["dir"], work["watch"])


def test_trace_output_in_missing_directory(work):
    check_bad_input(["trace", "torch_llama", "-o", "no_such_dir/out.h5"], work["dir"], work["watch"])
    assert not (work["dir"] / "no_such_dir").exists()


# ---------------------------------------------------------------------------------------------------------
# report and show
# ---------------------------------------------------------------------------------------------------------
def test_report_non_json_file(work):
    (work["dir"] / "report.json").write_text("this is { not json\n")
    check_bad_input(["report", "report.json"], work["dir"], work["watch"])


def test_report_binary_file(work):
    check_bad_input(["report", work["trace"]], work["dir"], work["watch"])


def test_report_missing_file(work):
    check_bad_input(["report", "nope.json"], work["dir"], work["watch"])


@pytest.mark.parametrize("content", [{"a": 1}, [1, 2], "just a string", {"records": [], "report_version": 1}],
                         ids=["dict", "list", "string", "only_the_two_checked_keys"])
def test_report_json_that_is_not_a_report(work, content):
    (work["dir"] / "report.json").write_text(json.dumps(content))
    check_bad_input(["report", "report.json"], work["dir"], work["watch"])


def test_report_refuses_existing_json_output(work):
    """A real report re-judged with --json onto an existing file: refused, file untouched."""
    proc = run_cli("align", work["trace"], work["trace"], "-q", "--json", "real.json", cwd=work["dir"])
    assert proc.returncode == 3, _describe(proc)  # aligned, but the same file twice
    (work["dir"] / "taken.json").write_text("keep")
    check_bad_input(["report", "real.json", "--json", "taken.json"], work["dir"], work["watch"])
    assert (work["dir"] / "taken.json").read_text() == "keep"


@pytest.mark.parametrize("kind", ["text", "hdf5_not_trace", "missing", "directory", "truncated_1000"])
def test_show_on_a_non_trace(work, kind):
    import h5py

    name = {"text": "notes.txt", "hdf5_not_trace": "other.h5", "missing": "missing.h5", "directory": "adir",
            "truncated_1000": "cut.h5"}[kind]
    path = work["dir"] / name
    if kind == "text":
        path.write_text("hello\n")
    elif kind == "hdf5_not_trace":
        with h5py.File(path, "w") as f:
            f["x"] = [1, 2, 3]
    elif kind == "directory":
        path.mkdir()
    elif kind == "truncated_1000":
        path.write_bytes(work["trace"].read_bytes()[:1000])
    check_bad_input(["show", name], work["dir"], work["watch"])


def test_good_input_is_not_rejected(work):
    """Control: the same helpers on valid input give exit 0 and create nothing (align without --json)."""
    before = snapshot(*work["watch"])
    proc = run_cli("align", work["trace"], work["llama"], "-q", cwd=work["dir"])
    assert proc.returncode == 0, _describe(proc)
    assert proc.stdout.startswith("aligned"), _describe(proc)
    proc = run_cli("show", work["trace"], cwd=work["dir"])
    assert proc.returncode == 0, _describe(proc)
    assert snapshot(*work["watch"]) == before
