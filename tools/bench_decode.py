"""The cost of reading a trace's index: its JSON lines decoded and checked into records, per record.

    python tools/bench_decode.py [--steps 4] [--repeat 7] [--json out.json]

Traces the torch_llama recipe (full mode, backward, ``--steps`` steps) once, then times the reader's index
decoding (``layerdiff.tracefile.index.parse_index``: every line verified, decoded and checked, what opening a trace costs
before any tensor is read) ``--repeat`` times and prints the best time per record and per MB of index. Run it on
two commits to compare two ways of decoding (the record count and index size say it is the same index).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib
import benchlib  # noqa: E402

TITLE = "Reading a trace's index"
METHOD = """The torch_llama recipe is traced once (full mode, backward, several steps); then the reader's index decoding
(every JSON line verified against its checksum, decoded into a typed record and checked: what opening a trace costs
before any tensor is read) is
timed several times on those bytes, best time kept, per record and per MB of index."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    import h5py

    import layerdiff
    from layerdiff.recipes import torch_llama
    from layerdiff.tracefile.index import parse_index

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.h5"
        built = torch_llama.build()
        with layerdiff.trace(built["model"], path):
            for _ in range(args.steps):
                built["step"]()
        with h5py.File(path, "r", locking=False) as f:
            raw, data_size = bytes(f["index"][:]), f["data"].shape[0]
    run = benchlib.BenchRun("bench_decode", TITLE, METHOD, packages=("numpy", "torch", "h5py", "msgspec"))
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        scan = parse_index(raw, data_size, checksummed=True)
        records, end = scan.records, scan.end
        times.append(time.perf_counter() - start)
    best = min(times)
    lines = len(records) + (end is not None)
    size = len(raw.rstrip(b"\0"))
    tensors = sum(len(r.tensors) for r in records)
    result = {"records": len(records), "tensor_entries": tensors, "index_bytes": size, "best_s": best,
              "us_per_record": best / lines * 1e6, "mb_per_s": size / best / 1e6}
    print(f"index of {len(records)} records, {tensors} tensor entries, {size / 1e6:.2f} MB")
    print(f"decoded and checked in {best * 1e3:.1f} ms (best of {args.repeat}): "
          f"{result['us_per_record']:.1f} us per record, {result['mb_per_s']:.0f} MB/s")
    if args.json:
        headline = f"{result['us_per_record']:.1f} us per record ({result['mb_per_s']:.0f} MB/s of index)"
        run.write(args.json, quick=args.steps < 4 or args.repeat < 7, headline=headline, results=result,
                  tables=[benchlib.table("Index decoding", ["records", "tensor entries", "index", "best time",
                                                            "per record", "throughput"],
                                         [[len(records), tensors, f"{size / 1e6:.2f} MB", f"{best * 1e3:.1f} ms",
                                           f"{result['us_per_record']:.1f} us", f"{result['mb_per_s']:.0f} MB/s"]])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
