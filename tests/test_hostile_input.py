"""Hostile, corrupt and foreign input to the parsers: safetensors headers, Hugging Face shard indexes, training
logs, JSON reports and trace index lines.

Each failure class runs through the real CLI (exit 2, exactly one ``layerdiff: error:`` line naming the file, no
traceback, nothing on disk created or changed); the details of each class are checked in-process; and each
parser is fuzzed with hypothesis: any input gives a result or a ``LayerdiffError``, never another exception
and never a hang (every call runs under a deadline). No framework is imported; the whole file takes seconds.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import math
import pickle
import signal
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from layerdiff import logs
from layerdiff.checkpoints import open_checkpoint
from layerdiff.report import jsonio, terminal
from layerdiff.checkpoints import safetensors_io
from layerdiff import schema
from layerdiff.tracefile import index as trace_index
from layerdiff.tracefile.reader import open_trace
from layerdiff.tracefile.tensors import STORAGE_DTYPES
from layerdiff.errors import LayerdiffError

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # the CLI and in-process tests still run
    st = None
else:  # hypothesis caches (unicode tables, constants) go to a temporary folder, not .hypothesis/ in the checkout
    _home = tempfile.TemporaryDirectory(prefix="layerdiff-hypothesis-")
    set_hypothesis_home_dir(_home.name)

needs_hypothesis = pytest.mark.skipif(st is None, reason="hypothesis is not installed")


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
class Hang(BaseException):
    """Raised by the deadline; a BaseException so that no ``except Exception`` in the code under test eats it."""


@contextlib.contextmanager
def deadline(seconds: float = 2.0):
    """Interrupt the block once it has used ``seconds`` of CPU time (SIGPROF), and fail it if it used more anyway
    (C code that the signal could not interrupt until it returned). CPU time, not wall time: a hang in parsing is
    work, and on a loaded CI machine the wall clock also counts the time other processes held the cores. A
    wall-clock backstop of ten times as long catches a block that waits instead of working."""
    def on_signal(signum, frame):
        kind = "of CPU time" if signum == signal.SIGPROF else "of wall time"
        raise Hang(f"still running after {seconds if signum == signal.SIGPROF else 10 * seconds} s {kind}")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGPROF, signal.SIGALRM)}
    signal.setitimer(signal.ITIMER_PROF, seconds)
    signal.setitimer(signal.ITIMER_REAL, 10 * seconds)
    start = time.process_time()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    used = time.process_time() - start
    assert used < seconds, f"used {used:.1f} s of CPU time (limit {seconds} s)"


def bounded(fn, *args, seconds: float = 2.0):
    """``fn(*args)`` under a deadline: its result, or the LayerdiffError it raised (any other exception fails)."""
    with deadline(seconds):
        try:
            return fn(*args)
        except LayerdiffError as exc:
            msg = str(exc)
            assert msg and "\n" not in msg, f"not one line: {msg!r}"
            return exc


def snapshot(root: Path) -> dict:
    """Every file and folder under root: size, mtime and content hash (folder mtimes catch temp files)."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st_ = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p)] = (st_.st_size, st_.st_mtime_ns, digest)
    return out


def check_cli_error(cwd: Path, *args, names: str, timeout: float = 60):
    """The bad-input contract: exit 2, one stderr line ``layerdiff: error: ...`` naming ``names``, no traceback
    (nor the CLI's "internal error" line for an exception the library let through), nothing on disk touched."""
    before = snapshot(cwd)
    code, out, err = run_cli(*args, cwd=cwd, timeout=timeout)
    shown = f"exit {code}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
    assert code == 2, shown
    assert "Traceback" not in out + err, shown
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerdiff: error:"), shown
    assert "internal error" not in err, shown
    assert names in err, shown
    assert snapshot(cwd) == before, f"files changed on disk\n{shown}"
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# builders: safetensors, HF index, traces, reports
# ---------------------------------------------------------------------------------------------------------
def st_bytes(header=None, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    """A safetensors file byte by byte: 8-byte little-endian header length, JSON header, data."""
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def f32(*shape, begin=0):
    n = int(np.prod(shape, dtype=np.int64)) * 4
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, begin + n]}


GOOD_ST = st_bytes({"w": f32(2, 2)}, np.arange(4, dtype=np.float32).tobytes())

# name -> (file bytes, fragment of the error); every one was a traceback or a wrong acceptance before
BAD_SAFETENSORS = {
    "overlap": (st_bytes({"a": f32(2), "b": f32(2, begin=4)}, bytes(12)), "overlap"),
    "zero_size_inside_another": (st_bytes({"a": f32(4), "z": f32(0, begin=8)}, bytes(16)), "overlap"),
    "duplicate_key": (st_bytes(raw=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                  b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', data=bytes(8)),
                      "appears twice"),
    "negative_offset": (st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, bytes(8)),
                        "negative or inverted"),
    "inverted_offsets": (st_bytes({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, bytes(8)),
                         "negative or inverted"),
    "offsets_not_two_ints": (st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, bytes(8)),
                             "two integers"),
    "offsets_huge": (st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [2 ** 64, 2 ** 64 + 8]}}, bytes(8)),
                     "64-bit"),
    "range_not_shape_x_dtype": (st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
                                "needs 12"),
    "shape_product_overflows": (st_bytes({"a": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 0]}}),
                                "overflows"),
    "shape_4000_digits": (st_bytes({"a": {"dtype": "U8", "shape": [10 ** 3999], "data_offsets": [0, 1]}}, bytes(1)),
                          "overflows"),
    "shape_negative": (st_bytes({"a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, bytes(8)),
                       "non-negative integers"),
    "shape_float": (st_bytes({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8)),
                    "non-negative integers"),
    "shape_bool": (st_bytes({"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, bytes(8)),
                   "non-negative integers"),
    "shape_too_many_dims": (st_bytes({"a": {"dtype": "U8", "shape": [1] * 40, "data_offsets": [0, 1]}}, bytes(1)),
                            "dimensions"),
    "unknown_dtype": (st_bytes({"a": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "Q4_K"),
    "dtype_not_a_string": (st_bytes({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
                           "dtype"),
    "entry_not_an_object": (st_bytes({"a": [1, 2, 3]}), "dtype, shape and data_offsets"),
    "header_length_over_file": (st_bytes(raw=b"{}", length=1000), "header length 1000"),
    "header_length_absurd": (st_bytes(raw=b"{}", length=2 ** 63), "100 MB"),
    "header_nested_deeply": (st_bytes(raw=b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested too deeply"),
    "header_not_an_object": (st_bytes(raw=b"[1, 2]"), "start with"),
    "header_nan_literal": (st_bytes(raw=b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, NaN]}}',
                                    data=bytes(8)), "not JSON"),
    "header_not_utf8": (st_bytes(raw=b'{"\xff": 1}'), "UTF-8"),
    "metadata_not_strings": (st_bytes({"__metadata__": {"format": 5}, "a": f32(1)}, bytes(4)), "__metadata__"),
    "hole_between_tensors": (st_bytes({"a": f32(1), "b": f32(1, begin=8)}, bytes(12)), "no holes"),
    "bytes_after_last_tensor": (st_bytes({"a": f32(1)}, bytes(12)), "belong to no tensor"),
    "truncated_data": (st_bytes({"a": f32(4)}, bytes(7)), "truncated"),
    "too_short": (b"\x01\x02", "8-byte"),
}


def write_index(folder: Path, content, *, shard: bytes | None = GOOD_ST) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if shard is not None:
        (folder / "model-00001-of-00001.safetensors").write_bytes(shard)
    text = content if isinstance(content, (str, bytes)) else json.dumps(content)
    (folder / "model.safetensors.index.json").write_bytes(text.encode() if isinstance(text, str) else text)
    return folder


SHARD = "model-00001-of-00001.safetensors"
BAD_INDEXES = {
    "nested_deeply": ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "not_json": ("{weight_map: nope", "not JSON"),
    "weight_map_missing": ({"metadata": {}}, "no weight_map"),
    "weight_map_a_list": ({"weight_map": [["w", SHARD]]}, "weight_map must be"),
    "weight_map_empty": ({"weight_map": {}}, "weight_map must be"),
    "shard_not_a_string": ({"weight_map": {"w": 5}}, "not a file name"),
    "shard_an_object": ({"weight_map": {"w": {"file": SHARD}}}, "not a file name"),
    "shard_empty": ({"weight_map": {"w": ""}}, "not a file name"),
    "shard_escapes_with_dotdot": ({"weight_map": {"w": "../x.safetensors"}}, "inside the folder"),
    "shard_escapes_deeper": ({"weight_map": {"w": "sub/../../x.safetensors"}}, "inside the folder"),
    "shard_absolute": ({"weight_map": {"w": "/etc/passwd"}}, "inside the folder"),
    "shard_nul": ({"weight_map": {"w": "a\0b"}}, "not a file name"),
    "shard_missing": ({"weight_map": {"w": "other.safetensors"}}, "is missing"),
    "tensor_not_in_shards": ({"weight_map": {"w": SHARD, "v": SHARD}}, "not in the shards"),
    "not_utf8": (b'{"weight_map": {"\xff": 1}}', "UTF-8"),
}

TRACE_STATS = {"numel": 2, "min": 0.0, "max": 1.0, "mean": 0.5, "l2": 1.0, "nan": 0, "inf": 0}


def param_line(**tensor_changes) -> bytes:
    t = {"role": "param", "key": "value", "dtype": "float32", "shape": [2], "stats": TRACE_STATS,
         "offset": 0, "nbytes": 8}
    t.update(tensor_changes)
    t = {k: v for k, v in t.items() if v is not DROP}
    return json.dumps({"kind": "param", "path": "w", "module": "", "module_type": "Model", "call": 0, "step": 0,
                       "tensors": [t]}).encode()


DROP = object()
END_LINE = json.dumps({"kind": "end", "status": "complete", "failure": None, "records": 1, "tensor_bytes": 8,
                       "steps": 1, "seconds": 0.1, "warnings": []}).encode()


def write_trace(path: Path, lines: list, data: bytes = np.array([1.0, 2.0], np.float32).tobytes()):
    """A trace by hand, as docs/trace-format.md describes it (plain h5py)."""
    import h5py

    index = b"".join(line + b"\n" for line in lines)
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "layerdiff-trace"
        f.attrs["format_version"] = 2
        f.attrs["meta"] = json.dumps({"mode": "full", "framework": "handmade"})
        f.create_dataset("index", data=np.frombuffer(index, np.uint8), maxshape=(None,), chunks=(4096,))
        f.create_dataset("data", data=np.frombuffer(data, np.uint8), maxshape=(None,), chunks=(4096,))
    return path


# damaged trace index lines: each is named as damage and skipped; the lines after it are read
BAD_TRACE_TENSORS = {
    "dtype_unknown": {"dtype": "float33"},
    "dtype_not_a_string": {"dtype": ["float32"]},
    "shape_not_a_list": {"shape": "2"},
    "shape_negative": {"shape": [-2], "nbytes": 8},
    "shape_float": {"shape": [2.0]},
    "shape_bool": {"shape": [True, 2]},
    "shape_overflows": {"shape": [2 ** 40, 2 ** 40]},
    "offset_negative": {"offset": -8},
    "offset_float": {"offset": 0.0},
    "offset_string": {"offset": "0"},
    "nbytes_negative": {"nbytes": -8},
    "nbytes_disagree_with_shape": {"nbytes": 4},
    "offset_without_nbytes": {"nbytes": DROP},
    "stats_not_an_object": {"stats": [1, 2]},
    "role_not_a_string": {"role": 3},
}


def tensor_row(role, key, *, max_abs=0.0, ref=1.0):
    return {"role": role, "key": key, "dtype_a": "float32", "dtype_b": "float32",
            "metrics": {"basis": "data", "identical": max_abs == 0.0, "max_abs": max_abs, "mean_abs": max_abs / 2,
                        "max_rel": max_abs / ref, "cosine": 1.0 - max_abs, "ref_max_abs": ref,
                        "nonfinite_mismatch": 0, "numel": 4}}


def record_row(kind, path, phase, begin, end, parent=None, tensors=(), module=None, type_a="Linear"):
    return {"kind": kind, "phase": phase, "path": path, "path_b": path, "call": 0, "step": 0,
            "type_a": type_a, "type_b": type_a, "begin": begin, "end": end, "parent": parent,
            "ancestors": [parent] if parent else [], "module": module, "hparams_a": {"eps": 1e-6},
            "hparams_b": {"eps": 1e-5}, "family_a": "linear", "family_b": "linear", "error_a": None,
            "error_b": None, "only_a": [], "only_b": [], "tensors": list(tensors)}


def small_report() -> dict:
    """A small align report (JSON shape of ``layerdiff align --json``): a model whose child diverges forward."""
    side = {"path": "a.h5", "framework": "torch", "framework_version": "2.0", "model_class": "m.Model",
            "mode": "full", "records": 3, "complete": True, "status": "complete", "failure": None, "warnings": [],
            "target": "recipe", "target_args": {"seed": 0}}
    records = [
        record_row("call", "", "forward", 0, 5, tensors=[tensor_row("input", "args.0"),
                                                         tensor_row("output", "out", max_abs=0.5)], type_a="Model"),
        record_row("call", "fc", "forward", 1, 2, parent=["", 0],
                   tensors=[tensor_row("input", "args.0"), tensor_row("output", "out", max_abs=0.5)]),
        record_row("call", "fc", "backward", 6, 7, tensors=[tensor_row("grad_output", "out"),
                                                            tensor_row("grad_input", "args.0", max_abs=0.1)]),
        record_row("param", "fc.weight", None, 0, 0, tensors=[tensor_row("param", "value")], module="fc",
                   type_a=None),
    ]
    return {"report_version": 1, "a": side, "b": {**side, "path": "b.h5"}, "basis": "data", "records": records,
            "structure": "same_model", "phases": {"forward": {"a": True, "b": True},
                                                  "backward": {"a": True, "b": True}},
            "same_file": False, "mapping": [{"a": "fc", "b": "fc", "confidence": 1.0, "reason": "same name"}],
            "unmatched_modules": {"a": [], "b": []}, "only_a": [], "only_b": [{"path": "extra"}],
            "first_nonfinite": {"a": None, "b": {"module": "fc", "phase": "forward", "tensor": "out", "nan": 1,
                                                 "inf": 0}}}


def evaluate_and_render(saved: dict) -> dict:
    """What ``layerdiff report`` does with an accepted report: evaluate, render, write JSON."""
    from rich.console import Console

    from layerdiff.judge.evaluate import evaluate
    from layerdiff.compare.tolerance import TolerancePolicy

    result = evaluate(saved, TolerancePolicy())
    terminal.render(result, Console(file=io.StringIO(), width=140))
    json.dumps(schema.json_safe(result))
    return result


def deep_report(levels: int) -> dict:
    """A report whose forward calls nest ``levels`` deep, every one divergent (evaluate descends it)."""
    doc = small_report()
    rows = [record_row("call", "m", "forward", 0, 2 * levels, tensors=[tensor_row("input", "x"),
                                                                       tensor_row("output", "y", max_abs=1.0)])]
    for i in range(1, levels):
        rows.append(record_row("call", "m" + ".c" * i, "forward", i, 2 * levels - i,
                               parent=["m" + ".c" * (i - 1), 0],
                               tensors=[tensor_row("input", "x"), tensor_row("output", "y", max_abs=1.0)]))
    doc["records"] = rows
    return doc


def megatron_line(i, loss=2.0):
    return (f" [2024-01-01 00:00:00] iteration {i:>9}/     1000 | consumed samples: 64 | learning rate: 1.0E-04 | "
            f"lm loss: {loss} | loss scale: 1.0 | grad norm: 3.000 | number of skipped iterations:   0 |")


GOOD_LOG = "\n".join(megatron_line(i, 10.0 - i / 10) for i in range(1, 6)) + "\n"
MS_PREFIX = "2024-01-01 00:00:00,123 - mindformers - INFO - { Epoch:[  1/  2], step:[    1/  100], "

BAD_LOGS = {  # name -> (file bytes, fragment of the error)
    "csv_field_over_limit": (b"step,loss\n1,1.0\n2," + b"1" * 200_000 + b"\n", "line 3: 200002 characters"),
    "csv_quoted_field_over_limit": (b"step,loss\n1,1.0\n2,\"" + b"1\n" * 100_000 + b"\"\n",
                                    "too long for a CSV log"),
    "megatron_5000_digit_iteration": ((GOOD_LOG + megatron_line("9" * 5000) + "\n").encode(), "5000 digits"),
    "mindspore_5000_digit_step": ((MS_PREFIX.replace("    1/", "9" * 5000 + "/") + "loss: 1.0, lr: 1e-05\n").encode(),
                                  "5000 digits"),
    "mindspore_iteration_overflow": ((MS_PREFIX.replace("  1/  2", "999999999999999/2").replace(
        "    1/  100", "1/999999999999999") + "loss: 1.0\n").encode(), "out of range"),
    "jsonl_400_digit_iteration": (b'{"iteration": ' + b"9" * 400 + b', "loss": 1.0}\n', "out of range"),
    "jsonl_infinite_iteration": (b'{"iteration": 1e999, "loss": 1.0}\n', "out of range"),
    "csv_iteration_overflow": (b"step,loss\n" + b"9" * 30 + b",1.0\n", "out of range"),
    "jsonl_nested_deeply": (b'{"iteration": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
                            "no training-log lines recognised"),
    "not_utf8": (GOOD_LOG.encode() + b"lm loss: caf\xe9\n", "not UTF-8"),
    "utf16": (GOOD_LOG.encode("utf-16"), "binary file"),
}


# ---------------------------------------------------------------------------------------------------------
# 1. safetensors headers
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["overlap", "negative_offset", "range_not_shape_x_dtype", "shape_product_overflows",
                                  "unknown_dtype", "header_length_over_file", "header_length_absurd",
                                  "header_nested_deeply"])
def test_cli_safetensors_header(tmp_path, case):
    (tmp_path / "a.safetensors").write_bytes(GOOD_ST)
    (tmp_path / "b.safetensors").write_bytes(BAD_SAFETENSORS[case][0])
    line = check_cli_error(tmp_path, "weights", "diff", "a.safetensors", "b.safetensors", "-o", "out.json",
                           names="b.safetensors")
    assert BAD_SAFETENSORS[case][1] in line


@pytest.mark.parametrize("case", sorted(BAD_SAFETENSORS))
def test_safetensors_header_refused(tmp_path, case):
    content, fragment = BAD_SAFETENSORS[case]
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    result = bounded(safetensors_io.read_header, path)
    assert isinstance(result, LayerdiffError), f"accepted: {result}"
    assert str(path) in str(result) and fragment in str(result)


def test_safetensors_valid_variants_accepted(tmp_path):
    """What the format allows stays readable: scalars, zero-size tensors (also sharing an offset), a header
    padded with spaces, metadata, entries listed out of data order, an empty file of tensors."""
    data = np.arange(3, dtype=np.float32).tobytes() + np.array([7], np.int64).tobytes()
    header = {"__metadata__": {"format": "pt"}, "z0": {"dtype": "BF16", "shape": [0, 4], "data_offsets": [12, 12]},
              "i": {"dtype": "I64", "shape": [], "data_offsets": [12, 20]}, "v": f32(3),
              "z1": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_bytes(raw=raw + b" " * (-len(raw) % 8), data=data))
    entries, meta = safetensors_io.read_header(path)
    assert meta == {"format": "pt"} and set(entries) == {"z0", "i", "v", "z1"}
    tensors, _ = safetensors_io.load(path)
    assert tensors["i"][0].shape == () and int(tensors["i"][0]) == 7 and tensors["z0"][0].shape == (0, 4)
    np.testing.assert_array_equal(tensors["v"][0], [0, 1, 2])
    (tmp_path / "empty.safetensors").write_bytes(st_bytes({}))
    assert safetensors_io.read_header(tmp_path / "empty.safetensors") == ({}, {})
    safetensors_io.save(tmp_path / "w.safetensors", {"a": (np.ones((2, 3), np.float32), "float32"),
                                                     "b": (np.zeros(5, np.uint16), "bfloat16")}, {"k": "v"})
    assert safetensors_io.read_header(tmp_path / "w.safetensors")[1] == {"k": "v"}


# ---------------------------------------------------------------------------------------------------------
# 2. Hugging Face model.safetensors.index.json (and --transpose regexes)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["nested_deeply", "weight_map_a_list", "shard_not_a_string",
                                  "shard_escapes_with_dotdot", "shard_absolute"])
def test_cli_hf_index(tmp_path, case):
    (tmp_path / "a.safetensors").write_bytes(GOOD_ST)
    write_index(tmp_path / "model", BAD_INDEXES[case][0])
    (tmp_path / "x.safetensors").write_bytes(GOOD_ST)  # what "../x.safetensors" would reach
    line = check_cli_error(tmp_path, "weights", "diff", "a.safetensors", "model", "-o", "out.json",
                           names="model.safetensors.index.json")
    assert BAD_INDEXES[case][1] in line


def test_cli_bad_transpose_regex(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(GOOD_ST)
    line = check_cli_error(tmp_path, "weights", "diff", "a.safetensors", "a.safetensors", "--transpose", "w(",
                           "-o", "out.json", names="--transpose 'w('")
    assert "missing )" in line


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_hf_index_refused(tmp_path, case):
    folder = write_index(tmp_path / "model", BAD_INDEXES[case][0])
    (tmp_path / "x.safetensors").write_bytes(GOOD_ST)
    result = bounded(open_checkpoint, folder)
    assert isinstance(result, LayerdiffError), f"accepted: {result}"
    assert BAD_INDEXES[case][1] in str(result) and "model" in str(result)


def test_hf_index_good_and_subfolder_shards_accepted(tmp_path):
    folder = write_index(tmp_path / "model", {"metadata": {"total_size": 16}, "weight_map": {"w": SHARD}})
    assert open_checkpoint(folder).names() == ["w"]
    (folder / "sub").mkdir()
    (folder / "sub" / "s.safetensors").write_bytes(st_bytes({"v": f32(1)}, bytes(4)))
    write_index(folder, {"weight_map": {"w": SHARD, "v": "sub/s.safetensors"}}, shard=None)
    assert sorted(open_checkpoint(folder).names()) == ["v", "w"]


def test_pickled_state_dict_nested_deeply_or_cyclic_refused(tmp_path):
    """Checkpoint readers flatten nested dicts without recursion: a hostile pickle is one error."""
    deep = {"w": np.zeros(2, np.float32)}
    for _ in range(200):
        deep = {"m": deep}
    cyclic = {"w": np.zeros(2, np.float32)}
    cyclic["self"] = cyclic
    for name, obj in (("deep", deep), ("cyclic", cyclic)):
        path = tmp_path / f"{name}.pdparams"
        path.write_bytes(pickle.dumps(obj, protocol=4))
        result = bounded(open_checkpoint, path)
        assert isinstance(result, LayerdiffError) and "nested more than" in str(result)
        assert str(path) in str(result)


# ---------------------------------------------------------------------------------------------------------
# 3. training logs
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["csv_field_over_limit", "megatron_5000_digit_iteration", "jsonl_nested_deeply",
                                  "not_utf8"])
def test_cli_logs(tmp_path, case):
    (tmp_path / "a.log").write_text(GOOD_LOG)
    (tmp_path / "b.log").write_bytes(BAD_LOGS[case][0])
    line = check_cli_error(tmp_path, "logs", "diff", "a.log", "b.log", "--json", "out.json", "--plot", "out.html",
                           names="b.log")
    assert BAD_LOGS[case][1] in line


@pytest.mark.parametrize("case", sorted(BAD_LOGS))
def test_log_refused(tmp_path, case):
    path = tmp_path / "run.log"
    path.write_bytes(BAD_LOGS[case][0])
    result = bounded(logs.load_log, path)
    assert isinstance(result, LayerdiffError), f"accepted: {result}"
    assert str(path) in str(result) and BAD_LOGS[case][1] in str(result)


def test_log_long_runs_of_spaces_do_not_hang(tmp_path):
    """``loss:`` followed by a long run of spaces and no number: linear, not quadratic, in the line length."""
    spaces = " " * 300_000
    path = tmp_path / "ms.log"
    path.write_text(f"{MS_PREFIX}loss:{spaces}x, lr:{spaces}, global_norm:{spaces}\n"
                    f"{MS_PREFIX.replace('step:[    1/', 'step:[    2/')}loss:[ 3.5/3.0], lr: [1e-05], "
                    "global_norm: [1.5]\n")
    fmt, data = bounded(logs.load_log, path, seconds=2.0)
    assert fmt == "mindspore" and data[2] == {"loss": 3.5, "lr": 1e-05, "grad_norm": 1.5}
    assert data[1] == {"loss": None, "lr": None, "grad_norm": None}


def test_log_tolerated_oddities(tmp_path):
    """Not errors: a UTF-8 BOM, a last character cut in half (a log still being written), stray JSON values of
    any type, a huge loss (infinite, compared as such), non-numeric iterations (rows skipped)."""
    path = tmp_path / "a.log"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LOG.encode() + "caf\u00e9".encode()[:-1])
    assert sorted(logs.load_log(path)[1]) == [1, 2, 3, 4, 5]
    path.write_text('{"iteration": 1, "loss": [1, 2], "lr": {"a": 1}, "grad_norm": ' + "9" * 400 + "}\n"
                    '{"iteration": "x", "loss": 1.0}\n{"iteration": NaN, "loss": 1.0}\n{"step": 2, "loss": "2.5"}\n')
    fmt, data = logs.load_log(path)
    assert fmt == "jsonl" and data == {1: {"loss": None, "lr": None, "grad_norm": math.inf},
                                       2: {"loss": 2.5, "lr": None, "grad_norm": None}}


# ---------------------------------------------------------------------------------------------------------
# 4. JSON reports given to `layerdiff report`
# ---------------------------------------------------------------------------------------------------------
def _mutated(change):
    doc = small_report()
    change(doc)
    return doc


def _drop(d, key):
    del d[key]


BAD_REPORTS = {
    "records_a_dict": lambda d: d.__setitem__("records", {"0": d["records"][0]}),
    "metrics_missing_max_abs": lambda d: _drop(d["records"][1]["tensors"][1]["metrics"], "max_abs")
    or d["records"][1]["tensors"][1]["metrics"].__setitem__("identical", False),
    "max_abs_not_numeric": lambda d: d["records"][1]["tensors"][1]["metrics"].__setitem__("max_abs", "big"),
    "ref_max_abs_null": lambda d: d["records"][1]["tensors"][1]["metrics"].__setitem__("ref_max_abs", None),
    "cosine_a_list": lambda d: d["records"][0]["tensors"][0]["metrics"].__setitem__("cosine", [1]),
    "max_abs_400_digits": lambda d: d["records"][1]["tensors"][1]["metrics"].__setitem__("max_abs", 10 ** 400),
    "metrics_not_an_object": lambda d: d["records"][0]["tensors"][0].__setitem__("metrics", [0.0]),
    "tensor_missing_role": lambda d: _drop(d["records"][0]["tensors"][0], "role"),
    "dtype_a_list": lambda d: d["records"][0]["tensors"][0].__setitem__("dtype_a", ["float32"]),
    "per_rank_metrics_not_objects": lambda d: d["records"][0]["tensors"][0]["metrics"].__setitem__(
        "ranks", {"0": 1.0, "how": "shards"}),
    "rank_number_unicode_digit": lambda d: d["records"][0]["tensors"][0]["metrics"].__setitem__(
        "ranks", {"\u00b2": dict(d["records"][0]["tensors"][0]["metrics"])}),
    "row_not_an_object": lambda d: d["records"].append("row"),
    "row_path_a_number": lambda d: d["records"][0].__setitem__("path", 5),
    "call_phase_unknown": lambda d: d["records"][1].__setitem__("phase", "sideways"),
    "call_without_type_a": lambda d: _drop(d["records"][1], "type_a"),
    "begin_a_string": lambda d: d["records"][1].__setitem__("begin", "1"),
    "parent_unhashable": lambda d: d["records"][1].__setitem__("parent", [[""], 0]),
    "ancestors_not_pairs": lambda d: d["records"][1].__setitem__("ancestors", [5]),
    "param_row_without_module": lambda d: d["records"][3].__setitem__("module", None),
    "only_a_on_row_not_strings": lambda d: d["records"][1].__setitem__("only_a", [1]),
    "side_not_an_object": lambda d: d.__setitem__("a", "a.h5"),
    "side_framework_a_number": lambda d: d["b"].__setitem__("framework", 7),
    "failure_stack_not_a_list": lambda d: d["b"].__setitem__("failure", {"module": "fc", "module_stack": "fc"}),
    "only_b_without_paths": lambda d: d.__setitem__("only_b", [{"kind": "call"}]),
    "first_nonfinite_a_list": lambda d: d.__setitem__("first_nonfinite", []),
    "mapping_without_confidence": lambda d: _drop(d["mapping"][0], "confidence"),
    "phases_values_not_objects": lambda d: d.__setitem__("phases", {"forward": True}),
    "unmatched_modules_not_strings": lambda d: d.__setitem__("unmatched_modules", {"b": [1]}),
    "calls_nested_500_deep": lambda d: d.update(deep_report(500)),
}


def test_small_report_is_valid():
    """The base of the report cases: accepted, evaluated and rendered (the forward origin is fc)."""
    doc = schema.loads(json.dumps(small_report()))
    assert jsonio.report_problem(doc) is None
    result = evaluate_and_render(doc)
    assert result["forward"]["first_divergence"]["module"] == "fc" and result["verdict"] == "divergent"
    assert jsonio.report_problem(deep_report(100)) is None
    evaluate_and_render(deep_report(100))  # a deep but bounded call tree: still evaluated


@pytest.mark.parametrize("case", ["records_a_dict", "metrics_missing_max_abs", "max_abs_not_numeric",
                                  "calls_nested_500_deep"])
def test_cli_report(tmp_path, case):
    (tmp_path / "r.json").write_text(json.dumps(_mutated(BAD_REPORTS[case])))
    line = check_cli_error(tmp_path, "report", "r.json", "--json", "out.json", names="r.json")
    assert "not a layerdiff align report" in line


@pytest.mark.parametrize("case", sorted(BAD_REPORTS))
def test_report_refused(tmp_path, case):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_mutated(BAD_REPORTS[case])))
    result = bounded(jsonio.read_json, path)
    assert isinstance(result, LayerdiffError), f"accepted: {case}"
    assert str(path) in str(result) and "not a layerdiff align report" in str(result)


def test_report_nested_deeply_refused(tmp_path):
    for depth in (500, 100_000):  # within json's recursion limit (then from_json_safe), and beyond it
        path = tmp_path / f"r{depth}.json"
        nested = "[" * depth + "]" * depth
        text = json.dumps(small_report())
        path.write_text(text.replace('"hparams_a": {"eps": 1e-06}', f'"hparams_a": {nested}', 1))
        result = bounded(jsonio.read_json, path)
        assert isinstance(result, LayerdiffError) and "nested" in str(result), result


# ---------------------------------------------------------------------------------------------------------
# 5. trace index lines
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["dtype_unknown", "shape_negative", "nbytes_disagree_with_shape"])
def test_cli_trace_index_line(tmp_path, case):
    """The trace's only parameter record is damaged: the reader skips it, names it, and the trace holds no
    parameter values (before: a traceback reading the tensor)."""
    (tmp_path / "a.safetensors").write_bytes(st_bytes({"w": f32(2)}, np.array([1, 2], np.float32).tobytes()))
    write_trace(tmp_path / "t.h5", [param_line(**BAD_TRACE_TENSORS[case]), END_LINE])
    line = check_cli_error(tmp_path, "weights", "diff", "a.safetensors", "t.h5", "-o", "out.json", names="t.h5")
    assert "no parameter values" in line and "1 damaged: index line 1" in line


def test_handmade_trace_control(tmp_path):
    """The same trace with an intact line reads, and compares equal to the same weights."""
    path = write_trace(tmp_path / "t.h5", [param_line(), END_LINE])
    with open_trace(path) as reader:
        assert len(reader.records) == 1 and reader.end.status == "complete" and not reader.crashed
        np.testing.assert_array_equal(reader.tensor(reader.records[0].tensors[0]), [1, 2])
    ck = open_checkpoint(path)
    assert ck.names() == ["w"] and ck.load("w")[0].tolist() == [1.0, 2.0]
    ck.close()


@pytest.mark.parametrize("case", sorted(BAD_TRACE_TENSORS))
def test_trace_index_line_is_named_and_the_lines_after_it_read(case):
    good = param_line()
    raw = b"\n".join([good, param_line(**BAD_TRACE_TENSORS[case]), good, END_LINE]) + b"\n"
    scan = bounded(trace_index.parse_index, raw, 8)
    assert len(scan.records) == 2 and scan.end is not None and not scan.torn
    assert [d.where.split(" (")[0] for d in scan.damage] == ["index line 2"], scan.damage


HOSTILE_INDEX_LINES = {
    "nested_deeply": b"[" * 100_000,
    "nested_in_a_record": b'{"kind": "param", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "kind_unhashable": b'{"kind": ["call"]}',
    "call_negative": b'{"kind": "call", "phase": "forward", "path": "", "call": -1, "tensors": []}',
    "end_failure_a_string": b'{"kind": "end", "failure": "boom"}',
    "end_tensors_a_number": b'{"kind": "end", "tensors": 0}',
    "step_a_string": b'{"kind": "param", "path": "w", "call": 0, "tensors": [], "step": "0"}',
    "not_utf8": b'{"kind": "param", "path": "\xff", "call": 0, "tensors": []}',
    "integer_5000_digits": b'{"kind": "param", "path": "w", "call": ' + b"9" * 5000 + b', "tensors": []}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_INDEX_LINES))
def test_trace_index_hostile_lines(name):
    raw = param_line() + b"\n" + HOSTILE_INDEX_LINES[name] + b"\n" + END_LINE
    scan = bounded(trace_index.parse_index, raw, 8)
    assert len(scan.records) == 1 and scan.end is not None and len(scan.damage) == 1


# ---------------------------------------------------------------------------------------------------------
# fuzzing: any input gives a result or a LayerdiffError, never another exception, never a hang
# ---------------------------------------------------------------------------------------------------------
FUZZ = dict(deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large] if st else [])

if st is not None:
    # no "[" in strings: render prints report strings as rich markup, where "[/x]" is an error of its own
    # (render escapes nothing; outside the parsers hardened here)
    plain_text = st.text(alphabet=st.characters(blacklist_characters="["), max_size=12)
    json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                            st.floats(allow_nan=True, allow_infinity=True), plain_text,
                            st.sampled_from(["inf", "-inf", "nan", "float32", "forward", "call", "param", ""]))
    json_values = st.recursive(json_leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(plain_text, inner, max_size=4)), max_leaves=12)
    int_like = st.one_of(st.integers(-3, 64), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([2 ** 63, 2 ** 64]),
                         json_leaves)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


if st is not None:
    @st.composite
    def safetensors_files(draw):
        """Mostly well-formed layouts with some fields broken, or raw bytes after a header length."""
        if draw(st.integers(0, 4)) == 0:
            body = draw(st.binary(max_size=300))
            length = draw(st.one_of(st.just(len(body)), st.integers(0, 2 ** 64 - 1)))
            return struct.pack("<Q", length) + body
        header, offset = {}, 0
        for i in range(draw(st.integers(0, 4))):
            dtype = draw(st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "Q4", "F32"]))
            shape = draw(st.lists(st.integers(0, 5), max_size=3))
            itemsize = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F8_E4M3": 1}.get(dtype, 4)
            n = int(np.prod(shape, dtype=np.int64)) * itemsize
            entry = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
            if draw(st.integers(0, 3)) == 0:  # break one field
                key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
                entry[key] = draw(st.one_of(int_like, st.lists(int_like, max_size=3), json_values))
            header[draw(st.text(max_size=6)) + str(i)] = entry
        if draw(st.booleans()):
            header["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4),
                                                                    max_size=2), json_values))
        raw = json.dumps(header).encode()
        data = bytes(max(0, offset + draw(st.sampled_from([0, 0, 0, -1, 1, 7]))))
        length = draw(st.sampled_from([len(raw), len(raw), len(raw) + 1, len(raw) - 1]))
        return struct.pack("<Q", max(length, 0)) + raw + data


@needs_hypothesis
def test_fuzz_safetensors_header(scratch):
    path = scratch / "f.safetensors"

    @settings(max_examples=250, **FUZZ)
    @given(safetensors_files())
    def check(content):
        path.write_bytes(content)
        result = bounded(safetensors_io.read_header, path)
        if isinstance(result, LayerdiffError):
            return
        entries, metadata = result  # accepted: the ranges tile the data region exactly, each one its shape's size
        assert isinstance(metadata, dict)
        data_start = 8 + struct.unpack("<Q", content[:8])[0]
        spans = sorted((off, off + n) for _, _, off, n in entries.values())
        position = data_start
        for begin, end in spans:
            assert begin == position
            position = end
        assert position == len(content)
        for name, (dtype, shape, _, nbytes) in entries.items():
            assert nbytes == int(np.prod(shape, dtype=np.int64)) * safetensors_io.storage_dtype(dtype).itemsize
        tensors, _ = safetensors_io.load(path)
        assert {k: list(v[0].shape) for k, v in tensors.items()} == {k: e[1] for k, e in entries.items()}

    check()


def _check_trace_records(records, data_size):
    """What every accepted record guarantees to the readers after it."""
    for rec in records:
        assert isinstance(rec.path, str) and type(rec.call) is int and rec.call >= 0
        for t in rec.tensors:
            assert t.dtype in STORAGE_DTYPES and isinstance(t.key, str) and isinstance(t.role, str)
            assert all(type(d) is int and d >= 0 for d in t.shape)
            if t.offset is not None:
                itemsize = np.dtype(STORAGE_DTYPES[t.dtype]).itemsize
                assert t.nbytes == int(np.prod(t.shape, dtype=np.int64)) * itemsize
                assert 0 <= t.offset and t.offset + t.nbytes <= data_size


if st is not None:
    @st.composite
    def index_bytes(draw):
        """An index: raw bytes, or lines of records with fields replaced by arbitrary JSON."""
        if draw(st.integers(0, 3)) == 0:
            return draw(st.binary(max_size=400))
        lines = []
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["call", "param", "param_grad", "param_grad_use", "end"]))
            rec = {"kind": kind, "path": "m.fc", "module": "m", "call": 0, "step": 0, "phase": "forward",
                   "begin": 1, "end": 2, "parent": ["m", 0], "tensors": []}
            if kind != "end":
                for _ in range(draw(st.integers(0, 2))):
                    shape = draw(st.lists(st.integers(0, 4), max_size=3))
                    dtype = draw(st.sampled_from(sorted(STORAGE_DTYPES)))
                    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(STORAGE_DTYPES[dtype]).itemsize
                    rec["tensors"].append({"role": "output", "key": "out", "dtype": dtype, "shape": shape,
                                           "stats": dict(TRACE_STATS), "offset": draw(st.integers(0, 64)),
                                           "nbytes": nbytes})
            for _ in range(draw(st.integers(0, 2))):  # damage: a record field, or a tensor field
                tensors = rec["tensors"]
                tensor = tensors[0] if isinstance(tensors, list) and tensors and isinstance(tensors[0], dict) \
                    else None
                target = tensor if tensor is not None and draw(st.booleans()) else rec
                key = draw(st.sampled_from(sorted(target)))
                target[key] = draw(st.one_of(int_like, json_values, st.lists(int_like, max_size=3)))
            lines.append(json.dumps(rec).encode())
        return b"\n".join(lines) + draw(st.sampled_from([b"\n", b"", b"\n\0\0\0", b'\n{"kind": "ca']))


@needs_hypothesis
def test_fuzz_trace_index():
    @settings(max_examples=300, **FUZZ)
    @given(index_bytes(), st.integers(0, 200))
    def check(raw, data_size):
        result = bounded(trace_index.parse_index, raw, data_size)
        assert not isinstance(result, LayerdiffError)
        _check_trace_records(result.records, data_size)
        assert result.end is None or result.end.kind == "end"

    check()


if st is not None:
    numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-10, 10 ** 6).map(str),
                        st.sampled_from(["9" * 30, "9" * 5000, "nan", "inf", "", " " * 50, "1e999", "[1.5]", "x"]),
                        st.text(max_size=6))

    @st.composite
    def log_text(draw):
        """Lines of each format with arbitrary numbers and junk, or arbitrary text, or arbitrary bytes."""
        choice = draw(st.integers(0, 5))
        if choice == 0:
            return draw(st.binary(max_size=300))
        if choice == 1:
            return draw(st.text(max_size=300)).encode("utf-8", "surrogatepass")
        lines = []
        for _ in range(draw(st.integers(1, 6))):
            n = [draw(numbers) for _ in range(5)]
            lines.append(draw(st.sampled_from([
                f"iteration {n[0]}/ {n[1]} | lm loss: {n[2]} | learning rate: {n[3]} | grad norm: {n[4]} |",
                f" iteration {len(n[0])}/ 100 | lm loss: {n[2]} | number of skipped iterations: {n[3]} |",
                f"{{ Epoch:[{n[0]}/2], step:[{n[1]}/{n[4]}], loss: {n[2]}, lr: [{n[3]}], global_norm: {n[4]}",
                f"{{ Epoch:[1/2], step:[3/10], loss:[{n[2]}/{n[3]}], overflow cond: True, global_norm: [{n[4]}]",
                f'{{"iteration": {n[0]}, "loss": {n[2]}, "lr": "{n[3]}", "grad_norm": {n[4]}}}',
                f'{{"step": {json.dumps(n[0])}, "loss": {json.dumps(n[2])}}}',
                f"{n[0]},{n[2]},{n[3]}",
                "step,loss,lr",
                draw(st.text(max_size=40)),
            ])))
        return "\n".join(lines).encode("utf-8", "surrogatepass")


@needs_hypothesis
def test_fuzz_log_parsers(scratch):
    path = scratch / "run.log"

    @settings(max_examples=300, **FUZZ)
    @given(log_text())
    def check(content):
        path.write_bytes(content)
        result = bounded(logs.load_log, path)
        if isinstance(result, LayerdiffError):
            assert str(path) in str(result)
            return
        fmt, data = result
        assert fmt in logs.PARSERS and data
        for iteration, rec in data.items():
            assert type(iteration) is int and abs(iteration) <= 2 ** 53
            assert set(rec) == set(logs.METRICS) and all(v is None or type(v) is float for v in rec.values())
        logs.diff(data, data)  # what `logs diff` then does with it (the plots are not covered here)

    check()


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


if st is not None:
    BASE_PATHS = [p for p in _paths(small_report()) if p]

    @st.composite
    def report_documents(draw):
        """Arbitrary JSON, or a valid report with a few values replaced or keys deleted."""
        if draw(st.integers(0, 4)) == 0:
            return draw(json_values)
        doc = small_report()
        for _ in range(draw(st.integers(1, 3))):
            where = draw(st.sampled_from(BASE_PATHS))
            parent = doc
            try:
                for k in where[:-1]:
                    parent = parent[k]
                if isinstance(parent, dict) and draw(st.integers(0, 3)) == 0:
                    parent.pop(where[-1], None)
                else:
                    parent[where[-1]] = draw(st.one_of(json_values, int_like, st.lists(int_like, max_size=3)))
            except (KeyError, IndexError, TypeError):  # an earlier change moved the path
                pass
        return doc


@needs_hypothesis
def test_fuzz_report_read_json(scratch):
    path = scratch / "r.json"

    @settings(max_examples=250, **FUZZ)
    @given(report_documents(), st.booleans())
    def check(doc, as_text):
        path.write_text(json.dumps(doc) if as_text else json.dumps(doc)[: max(1, len(json.dumps(doc)) // 2)])
        result = bounded(jsonio.read_json, path)
        if isinstance(result, LayerdiffError):
            assert str(path) in str(result)
            return
        with deadline(5.0):  # accepted: what `layerdiff report` does next works
            evaluate_and_render(copy.deepcopy(result))

    check()


def test_evaluate_leaves_the_measurements_alone_and_rejudges_independently():
    """Judging is a pure function: a report re-thresholded twice gives each policy its own verdict, and the
    measurements it was given are unchanged (no tensor keeps another judgement's "passed" or "tolerance")."""
    from layerdiff.judge.evaluate import evaluate
    from layerdiff.compare.tolerance import TolerancePolicy

    saved = small_report()
    before = json.dumps(saved, sort_keys=True)
    strict = evaluate(saved, TolerancePolicy())
    loose = evaluate(saved, TolerancePolicy(atol=10.0, rtol=1.0, cos=0.0))
    assert json.dumps(saved, sort_keys=True) == before
    assert strict["verdict"] == "divergent" and strict["forward"]["first_divergence"]["module"] == "fc"
    assert loose["forward"]["first_divergence"] is None
    judged = [t for r in strict["records"] for t in r["tensors"]]
    assert judged and all("passed" in t for t in judged) and not all(t["passed"] for t in judged)
    assert all(t["passed"] for r in loose["records"] for t in r["tensors"])
