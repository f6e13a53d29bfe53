"""docs/benchmarks/ is generated from the benchmark tools' JSON output (tools/bench_pages.py): the pages match the
data, and a page says where its figures come from. Standard library only: no framework is imported."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "tools" / "bench_pages.py"

DOC = {
    "schema": "layerdiff-bench/1", "tool": "bench_demo", "title": "A synthetic benchmark",
    "command": "python tools/bench_demo.py --quick --json docs/benchmarks/data/bench_demo.json",
    "commit": "abc1234+dirty", "date": "2026-11-24T10:11:12+00:00", "duration_s": 12.3, "quick": True,
    "machine": {"cores": 2, "memory_gb": 25.3, "cpu": "Some CPU", "python": "3.11.7", "numpy": "1.26.4"},
    "method": "Times a step untraced and traced,\nmedian of 3.", "headline": "`stats` 1.25x the untraced step",
    "tables": [{"title": "Step time", "columns": ["mode", "step"], "rows": [["untraced", "10.0 ms"],
                                                                         ["stats | traced", "12.5 ms"]],
                "note": "Median of 3 steps."}],
    "results": {"untraced_s": 0.01, "stats_s": 0.0125},
}


def pages(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PAGES), *args], capture_output=True, text=True, timeout=60)


def test_pages_match_the_data():
    result = pages("--check")
    assert result.returncode == 0, result.stderr


def test_a_page_names_its_command_commit_and_date(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    (data / "bench_demo.json").write_text(json.dumps(DOC))
    assert pages("--data", str(data), "--out", str(out), "--check").returncode == 1  # nothing generated yet
    result = pages("--data", str(data), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["bench_demo.md", "index.md"]
    page = (out / "bench_demo.md").read_text()
    for text in (DOC["command"], "abc1234+dirty", "2026-11-24T10:11:12+00:00", "Quick run", "Some CPU",
                 "Times a step untraced and traced, median of 3.", "| stats \\| traced | 12.5 ms |",
                 "python tools/bench_pages.py", "--json docs/benchmarks/data/bench_demo.json"):
        assert text in page, text
    index = (out / "index.md").read_text()
    assert "[A synthetic benchmark](bench_demo.md)" in index
    assert "`abc1234+dirty`" in index and "2026-11-24T10:11:12+00:00" in index and DOC["command"] in index
    assert "(quick run)" in index

    # the same data gives the same pages; --check sees an edit by hand and a page whose data is gone
    assert pages("--data", str(data), "--out", str(out), "--check").returncode == 0
    first = {p.name: p.read_text() for p in out.iterdir()}
    assert pages("--data", str(data), "--out", str(out)).returncode == 0
    assert {p.name: p.read_text() for p in out.iterdir()} == first
    (out / "bench_demo.md").write_text(page.replace("12.5 ms", "11.0 ms"))
    assert pages("--data", str(data), "--out", str(out), "--check").returncode == 1
    (data / "bench_demo.json").unlink()
    assert pages("--data", str(data), "--out", str(out), "--check").returncode == 1
    assert pages("--data", str(data), "--out", str(out)).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.md"]


def test_a_document_without_its_metadata_is_refused(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"untraced_step_s": 0.1}))
    result = pages("--data", str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "missing tool, command, commit, date" in result.stderr
