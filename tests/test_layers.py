"""The house's structure holds: the passes are layered (pyproject's import-linter contracts), and no module shares
a name with a public ``layerdiff`` function (importing such a module would replace the function on the package)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold():
    pytest.importorskip("importlinter")
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint) if lint.exists() else "lint-imports"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "passes are layered KEPT" in done.stdout and "import no framework KEPT" in done.stdout


def test_no_module_is_named_like_a_public_function():
    import layerdiff

    public = set(layerdiff.__all__)
    top = {p.stem for p in (ROOT / "layerdiff").glob("*.py")} | {p.name for p in (ROOT / "layerdiff").iterdir()
                                                                if p.is_dir() and (p / "__init__.py").exists()}
    assert not public & top, public & top


def test_the_type_checker_passes(tmp_path):
    """mypy (settings in pyproject: untyped functions are checked too) finds nothing in the package."""
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout


FRAMEWORK_FREE_TESTS = ["tests/judge/test_call_tree.py", "tests/match/test_module_mapping.py",
                        "tests/match/test_rules.py", "tests/compare/test_metrics.py", "tests/logs/test_logs.py",
                        "tests/tracefile/test_index_lines.py", "tests/runs/test_parallel_layout.py",
                        "tests/match/test_op_arguments.py", "tests/tracefile/test_checksums.py"]


def test_the_framework_free_tests_pass_with_every_framework_blocked():
    """Matching and judging are tested on synthetic records (``tests/builders.py``): those tests run where no
    framework can be imported."""
    blocked = ["torch", "paddle", "mindspore", "megatron", "transformers"]
    code = (f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
            "import pytest\n"
            f"rc = pytest.main(['-q', '-rs', '-p', 'no:xdist', '-p', 'no:cacheprovider', '-o', 'addopts=', "
            f"*{FRAMEWORK_FREE_TESTS!r}])\n"
            f"assert all(sys.modules.get(name) is None for name in {blocked!r}), 'a framework was imported'\n"
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-2000:]
    # none skipped for want of a framework (a test skipped where this machine lacks a C compiler is not one)
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skips if "import" in line or any(name in line for name in blocked)], skips
