"""Trace file reading paths agree with each other and with plain h5py."""

import h5py
import numpy as np
import pytest

pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.tracefile.reader import open_trace
from layerdiff.tracefile.records import decode_line  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

pytestmark = [pytest.mark.torch]


@pytest.mark.parametrize("compression", [None, "gzip", "lzf"])
def test_every_tensor_reads_the_same_through_layerdiff_and_plain_h5py(tmp_path, compression):
    built = torch_llama.build()
    path = tmp_path / "t.h5"
    with layerdiff.trace(built["model"], path, compression=compression, flush_interval=0):
        built["step"]()
    with open_trace(path) as reader, h5py.File(path, "r", locking=False) as f:
        assert (reader._raw is None) == (compression is not None)  # direct chunk reads only when unfiltered
        lines = [decode_line(x) for x in bytes(f["index"][:]).rstrip(b"\0").splitlines() if x]
        assert [r for r in lines if r.kind != "end"] == reader.records
        entries = [t for r in reader.records for t in r.tensors if t.offset is not None]
        assert len(entries) > 100
        for t in entries:
            ours = reader.tensor(t).reshape(-1).view(np.uint8)
            plain = f["data"][t.offset:t.offset + t.nbytes]
            assert np.array_equal(ours, plain)
            pieces = np.concatenate([c.view(np.uint8).copy() for c in reader.tensor_chunks(t, 1000)]) if t.nbytes else ours
            assert np.array_equal(pieces, plain)


def test_compressed_traces_align_like_uncompressed(tmp_path, recipe_trace, align_paths):
    built = torch_llama.build("eps")
    path = tmp_path / "gz.h5"
    with layerdiff.trace(built["model"], path, compression="gzip"):
        built["step"]()
    report = align_paths(recipe_trace(), path)
    assert report["forward"]["first_divergence"]["module"] == torch_llama.DEFECTS["eps"][1]


def test_deduplicated_tensors_share_bytes_and_keep_their_own_keys(tmp_path):
    built = torch_llama.build()
    path = tmp_path / "t.h5"
    with layerdiff.trace(built["model"], path):
        built["step"]()
    with open_trace(path) as r:
        calls = {(c.path, c.phase): c for c in r.records if c.kind == "call"}
        out0 = next(t for t in calls[("model.layers.0", "forward")].tensors if t.role == "output")
        in1 = next(t for t in calls[("model.layers.1", "forward")].tensors if t.role == "input"
                   and t.key == "args.0")
        assert (out0.offset, out0.nbytes) == (in1.offset, in1.nbytes)  # stored once
        assert (out0.key, in1.key) == ("out", "args.0")
        total = sum(t.nbytes for c in r.records for t in c.tensors if t.offset is not None)
        unique = sum(n for _, n in {(t.offset, t.nbytes) for c in r.records for t in c.tensors
                                    if t.offset is not None})
        assert unique == r.end.tensor_bytes < total
