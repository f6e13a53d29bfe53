"""A finished trace damaged afterwards (bit rot, a bad copy): every byte flipped is reported, or harmless; the
records after a damaged one are read; align never says "aligned" at exit 0 from damaged data.

Real traces of the torch_llama recipe (105 records, forward and backward). Seeded flips cover every index line
(its body, its checksum, its newline, in turn), the stored tensor bytes and the HDF5 metadata (superblock, object
headers, chunk indexes, the metadata attribute). For each damaged copy: either the file is refused as damaged
(exit 2, one line), or the reader reports damage, or nothing it reads differs from the undamaged file (harmless);
every record the reader gives equals the undamaged one, no more records are missing than damaged parts named,
every tensor reads back as written or raises ``DamagedTensorError``; and align exits 0 only where the flip was
harmless.
"""
from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import align_files, run_cli
from layerdiff import api
from layerdiff.compare import tasks as compare_tasks
from layerdiff.compare import workers as compare_workers
from layerdiff.errors import LayerdiffError
from layerdiff.tracefile.checksums import SUFFIX_LENGTH, DamagedTensorError
from layerdiff.tracefile.reader import open_trace

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]


def _regions(path: Path) -> dict:
    """File addresses of the index's and the data's used bytes, and of the HDF5 metadata (every byte before the
    first chunk, and the bytes past the chunks that are not zero: the free space is zeros)."""
    with h5py.File(path, "r", locking=False) as f:
        chunks = {}
        for name in ("index", "data"):
            dataset, size = f[name], f[name].shape[0]
            spans = []
            for i in range(dataset.id.get_num_chunks()):
                info = dataset.id.get_chunk_info(i)
                spans.append((info.chunk_offset[0], info.byte_offset, info.size))
            chunks[name] = (size, sorted(spans))
    raw = path.read_bytes()
    inside = np.zeros(len(raw), dtype=bool)
    for size, spans in chunks.values():
        for _, address, length in spans:
            inside[address:address + length] = True
    first = min(address for _, spans in chunks.values() for _, address, _ in spans)
    outside = np.flatnonzero(~inside)
    metadata = [int(i) for i in outside if i < first or raw[i]]
    return {"chunks": chunks, "metadata": metadata}


def _logical(chunks, name: str, position: int) -> int:
    """The file address of byte ``position`` of dataset ``name``."""
    _, spans = chunks[name]
    for start, address, length in spans:
        if start <= position < start + length:
            return address + position - start
    raise ValueError(position)


def _flips(path: Path, seed: int = 31) -> list:
    """[(part, file address, xor)]: one flip in every index line (its body, its checksum suffix or its newline, in
    turn), 40 in the tensor bytes, 60 in the HDF5 metadata."""
    rng = random.Random(seed)
    regions = _regions(path)
    chunks = regions["chunks"]
    with h5py.File(path, "r", locking=False) as f:
        index = bytes(f["index"][:]).rstrip(b"\0")  # the unused reserve's zeros: not written, not read
    with open_trace(path) as reader:
        data_size = max(t.offset + t.nbytes for r in reader.records for t in r.tensors if t.offset is not None)
    flips, start = [], 0
    for n, line in enumerate(index.split(b"\n")[:-1]):
        part = ("body", "checksum", "newline")[n % 3]
        if part == "body":
            at = start + rng.randrange(len(line) - SUFFIX_LENGTH)
        elif part == "checksum":
            at = start + len(line) - SUFFIX_LENGTH + rng.randrange(SUFFIX_LENGTH)
        else:
            at = start + len(line)
        flips.append((f"index {part}", _logical(chunks, "index", at), rng.randrange(1, 256)))
        start += len(line) + 1
    flips += [("data", _logical(chunks, "data", rng.randrange(data_size)), rng.randrange(1, 256)) for _ in range(40)]
    flips += [("metadata", rng.choice(regions["metadata"]), rng.randrange(1, 256)) for _ in range(60)]
    return flips


def _contents(path: Path):
    """(records, {(record number, tensor number): bytes}, end) of an undamaged trace."""
    with open_trace(path) as reader:
        assert not reader.damage and not reader.crashed
        return list(reader.records), {(i, j): reader.tensor(t).tobytes() for i, rec in enumerate(reader.records)
                                      for j, t in enumerate(rec.tensors)}, reader.end


def _judge_flip(path: Path, original) -> str:
    """"refused", "reported" or "harmless" for a damaged copy; fails on anything silent or lost."""
    records, tensors, end = original
    try:
        reader = open_trace(path)
    except LayerdiffError as exc:
        assert "\n" not in str(exc)
        return "refused"
    with reader:
        position = {repr(rec): i for i, rec in enumerate(records)}
        got = [position.get(repr(rec)) for rec in reader.records]
        assert None not in got, "a record that reads otherwise than written, not reported"
        assert got == sorted(got), "records out of order"
        lost = len(records) - len(got)
        assert lost <= len(reader.damage), f"{lost} records missing, {len(reader.damage)} damaged parts named"
        damaged_tensors = 0
        for rec, i in zip(reader.records, got):
            for j, entry in enumerate(rec.tensors):
                try:
                    values = reader.tensor(entry).tobytes()
                except DamagedTensorError:
                    damaged_tensors += 1
                    continue
                assert values == tensors[(i, j)], f"tensor {j} of {rec.path} reads otherwise, not reported"
        if reader.end is not None:
            assert reader.end == end
        else:
            assert reader.damage, "the end record lost without a word"
        if reader.damage or damaged_tensors:
            return "reported"
        assert lost == 0 and reader.meta and not reader.crashed
        return "harmless"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from layerdiff.recipes import torch_llama

    import layerdiff

    root = tmp_path_factory.mktemp("damage")
    for name in ("a.h5", "b.h5"):
        built = torch_llama.build()
        with layerdiff.trace(built["model"], root / name):
            built["step"]()
    return root


@pytest.mark.slow
def test_every_flip_is_reported_or_harmless_and_never_aligned_at_exit_0(traces):
    reference, clean = traces / "a.h5", traces / "b.h5"
    assert api.align(reference, clean).exit_code == 0
    original = _contents(clean)
    flips = _flips(clean)
    assert sum(part.startswith("index") for part, _, _ in flips) == len(original[0]) + 1  # every line, the end's too
    raw = clean.read_bytes()
    outcomes: Counter = Counter()
    damaged = traces / "damaged.h5"
    for part, address, xor in flips:
        copy = bytearray(raw)
        copy[address] ^= xor
        damaged.write_bytes(copy)
        outcome = _judge_flip(damaged, original)
        outcomes[part, outcome] += 1
        try:
            code = api.align(reference, damaged).exit_code
        except LayerdiffError:
            code = 2
        assert code != 0 or outcome == "harmless", (part, address, xor, outcome)
        assert code in (0, 1, 2, 3)
        if outcome == "refused":
            assert code == 2
    print(dict(sorted(outcomes.items())))
    # a changed byte of a line or of its checksum is always found; a changed newline joins two lines that are
    # both read back whole (cut again after the first one's checksum), so it is harmless
    assert not outcomes["index body", "harmless"] and not outcomes["index checksum", "harmless"]
    assert outcomes["data", "reported"] == 40  # every tensor byte is covered by a checksum


def test_a_flipped_digit_is_damage_not_an_interruption_and_the_records_after_it_are_read(traces, tmp_path):
    """The issue's case: a digit of a statistic changed in the middle of the index. Before: read as "interrupted",
    every later record dropped (35 of 105), or the changed value compared as real."""
    clean = traces / "b.h5"
    records, _, _ = _contents(clean)
    damaged = tmp_path / "digit.h5"
    shutil.copy(clean, damaged)
    with h5py.File(damaged, "r+", locking=False) as f:
        index = bytearray(f["index"][:])
        lines = bytes(index).split(b"\n")
        l2 = lines[70].index(b'"l2":')
        at = sum(len(line) + 1 for line in lines[:70]) + lines[70].index(b".", l2) + 2  # a digit after the point
        index[at] = ord("7") if index[at] != ord("7") else ord("3")  # still JSON, still a number
        f["index"][:] = np.frombuffer(bytes(index), dtype=np.uint8)
    with open_trace(damaged) as reader:
        assert not reader.crashed and reader.end is not None
        assert len(reader.records) == len(records) - 1 and reader.records[70:] == records[71:]
        [damage] = reader.damage
        assert damage.where.startswith("index line 71 ") and "checksum does not match" in damage.why
        assert damage.reads_as == f"{records[70].kind} {records[70].phase} {records[70].path} call {records[70].call}"
    report = align_files(traces / "a.h5", damaged)
    assert report["verdict"] == "aligned" and not report["trust"]["ok"]
    assert "is damaged: 1 part(s)" in report["trust"]["problems"][0] and "index line 71" in \
        report["trust"]["problems"][0]
    assert api.align(traces / "a.h5", damaged).exit_code == 3


def test_a_flipped_tensor_byte_is_named_and_compared_by_its_statistics(traces, tmp_path):
    """A flip inside stored tensor bytes, below any tolerance: before, "aligned" at exit 0."""
    clean = traces / "b.h5"
    records, _, _ = _contents(clean)
    rec = next(r for r in records if r.kind == "call" and r.path == "model.layers.0.mlp" and r.phase == "forward")
    entry = next(t for t in rec.tensors if t.role == "output")
    damaged = tmp_path / "bytes.h5"
    shutil.copy(clean, damaged)
    with h5py.File(damaged, "r+", locking=False) as f:
        f["data"][entry.offset] ^= 1  # the lowest mantissa bit of one float32
    with open_trace(damaged) as reader:
        assert not reader.damage  # the index is whole: the damage shows when the bytes are read
        with pytest.raises(DamagedTensorError, match="output out .* do not match their checksum"):
            reader.tensor(entry)
        with pytest.raises(DamagedTensorError):
            for _ in reader.tensor_chunks(entry, 1000):
                pass
    report = align_files(traces / "a.h5", damaged)
    row = next(r for r in report["records"] if r["path"] == "model.layers.0.mlp" and r["phase"] == "forward")
    metrics = next(t["metrics"] for t in row["tensors"] if t["role"] == "output")
    assert metrics["basis"] == "stats" and metrics["damaged"].startswith("B: ")
    assert any(d.startswith("call forward model.layers.0.mlp call 0 output out: B: ") for d in report["b"]["damage"])
    assert report["verdict"] == "aligned" and api.align(traces / "a.h5", damaged).exit_code == 3


@pytest.mark.slow
def test_workers_verify_the_slices_they_read(traces, tmp_path, monkeypatch):
    """Worker processes read tensor bytes straight from the mapped file: they verify them too, and align's report
    names the same damage with and without them."""
    clean = traces / "b.h5"
    records, _, _ = _contents(clean)
    largest = max((t for r in records for t in r.tensors if t.offset is not None), key=lambda t: t.nbytes)
    damaged = tmp_path / "bytes.h5"
    shutil.copy(clean, damaged)
    with h5py.File(damaged, "r+", locking=False) as f:
        f["data"][largest.offset + largest.nbytes - 3] ^= 0x40
    serial = api.align(traces / "a.h5", damaged, workers=1).data
    monkeypatch.setattr(compare_tasks, "LOCAL_MIN_BYTES", 0)  # small traces: to worker processes all the same
    monkeypatch.setattr(compare_workers, "SLICE_BYTES", 64 << 10)  # many slices: the damage is in the last one
    parallel = api.align(traces / "a.h5", damaged, workers=2).data
    assert serial["b"]["damage"] and len(parallel["b"]["damage"]) == len(serial["b"]["damage"])
    assert [d.split(": ")[0] for d in parallel["b"]["damage"]] == [d.split(": ")[0] for d in serial["b"]["damage"]]
    assert "do not match their checksum" in parallel["b"]["damage"][0]
    assert serial["trust"]["problems"] and parallel["trust"]["problems"]


@pytest.mark.slow
def test_cli_names_the_damage_and_refuses_a_trace_with_nothing_left(traces, tmp_path):
    clean = traces / "b.h5"
    damaged = tmp_path / "digit.h5"
    shutil.copy(clean, damaged)
    with h5py.File(damaged, "r+", locking=False) as f:
        index = bytearray(f["index"][:])
        index[300] ^= 0x01
        f["index"][:] = np.frombuffer(bytes(index), dtype=np.uint8)
    code, out, err = run_cli("align", traces / "a.h5", damaged, "-q")
    assert code == 3 and out.startswith("aligned") and "is damaged" in out and "index line 1" in out, (out, err)
    code, out, err = run_cli("show", damaged)
    assert code == 0 and "DAMAGED: index line 1" in out and "interrupted" not in out, out
    ruined = tmp_path / "ruined.h5"
    shutil.copy(clean, ruined)
    with h5py.File(ruined, "r+", locking=False) as f:
        index = np.array(f["index"][:])
        index[index == ord(b"{")] = ord(b"[")  # every line
        f["index"][:] = index
    code, out, err = run_cli("align", traces / "a.h5", ruined)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "damaged, no usable module call left" in err


def _without_checksums(source: Path, target: Path):
    """The trace as a layerdiff before checksums wrote it (format 2): lines and entries without them."""
    with h5py.File(source, "r", locking=False) as f:
        meta, lines = f.attrs["meta"], bytes(f["index"][:]).rstrip(b"\0").split(b"\n")
        data = f["data"][:]
    records = []
    for line in filter(None, lines):
        record = json.loads(line)
        record.pop("checksum")
        for tensor in record.get("tensors", []):
            tensor.pop("checksums", None)
        records.append(json.dumps(record).encode())
    with h5py.File(target, "w") as f:
        f.attrs.update({"format": "layerdiff-trace", "format_version": 2, "meta": meta})
        f.create_dataset("index", data=np.frombuffer(b"\n".join(records) + b"\n", np.uint8), maxshape=(None,))
        f.create_dataset("data", data=data, maxshape=(None,), chunks=(1 << 20,))


def test_a_trace_written_before_checksums_aligns_with_a_note(traces, tmp_path):
    old = tmp_path / "old.h5"
    _without_checksums(traces / "b.h5", old)
    with open_trace(old) as reader:
        assert reader.unverified == len(reader.records) + 1 and not reader.damage and not reader.checksummed
    report = api.align(traces / "a.h5", old)
    assert report.exit_code == 0 and report.verdict == "aligned"
    assert report.data["trust"]["notes"] == [f"B ({old}) cannot be verified: written before checksums (trace format "
                                             "2 or older), so damage to it would go unnoticed"]
    assert "note: B" in report.summary()
