"""The README's first screen and CI stay true to each other."""
import re
from pathlib import Path

from layerdiff.adapters import FRAMEWORKS

ROOT = Path(__file__).resolve().parent.parent


def _first_screen_commands():
    text = (ROOT / "README.md").read_text().splitlines()[:40]
    return [line.strip() for line in text if line.startswith("    pip install")]


def test_readme_first_screen_has_the_two_commands():
    commands = _first_screen_commands()
    assert len(commands) == 2
    demo, tests = commands
    assert demo.endswith("layerdiff demo") and "-c constraints.txt" in demo
    assert tests.endswith("python -m pytest") and "-c constraints.txt" in tests


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == _first_screen_commands()[1]


def test_constraints_pin_the_local_torch_wheel_and_numpy_below_2():
    pins = (ROOT / "constraints.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", pins, re.M) and re.search(r"^numpy<2$", pins, re.M)


def test_framework_extras_do_not_pull_each_other():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(dep.startswith(("paddle", "mindspore")) for dep in extras["torch"])
    assert not any(dep.startswith(("torch", "mindspore")) for dep in extras["paddle"])
    assert not any(dep.startswith(("torch", "paddle")) for dep in extras["mindspore"])
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    always = [d for d in core if ";" not in d]
    # pyyaml: config diff; orjson: the index lines (a tenth of json's time, the tracer's per-record cost);
    # msgspec: the index lines read back into typed records, checked as they are decoded (5.9x json + a check);
    # xxhash: the trace's checksums (XXH3: 4x crc32c's speed, so hashing stays a few percent of the write speed);
    # mypy_extensions: ``mypyc_attr``, what the recording's modules allow where they are compiled (layerdiff/native.py)
    assert sorted(d.split(">")[0] for d in always) == ["h5py", "msgspec", "mypy_extensions", "numpy", "orjson",
                                                       "pyyaml", "rich", "xxhash"]
    assert [d for d in core if ";" in d] == ["tomli>=1.1; python_version < '3.11'"]  # tomllib before 3.11


# The only modules that may import a framework, each for a reason; every other module of every package is
# framework-free (a new package is covered without being listed)
FRAMEWORK_MODULES = {
    # the adapters: adapters/<framework>_adapter.py and its helpers (adapters/torch_ops.py), per framework
    *(str(p.relative_to(ROOT / "layerdiff")) for name in FRAMEWORKS
      for p in (ROOT / "layerdiff" / "adapters").glob(f"{name}_*.py")),
    "checkpoints/formats.py", "checkpoints/torch_dcp.py", "checkpoints/megatron.py",  # torch.load(weights_only)
    "demo.py",  # checks that the demo's frameworks are installed
}


FRAMEWORK_IMPORT = re.compile(rf"^\s*(import|from)\s+({'|'.join(FRAMEWORKS + ('megatron', 'transformers'))})\b", re.M)


def test_core_never_imports_a_framework():
    checked = 0
    for path in (ROOT / "layerdiff").rglob("*.py"):
        if str(path.relative_to(ROOT / "layerdiff")) in FRAMEWORK_MODULES:
            continue
        source = path.read_text()
        assert not FRAMEWORK_IMPORT.search(source), path
        checked += 1
    assert checked > 60  # every package, not a folder that is now nearly empty


def test_the_documented_rule_file_example_is_a_rule_file(tmp_path):
    from layerdiff.match.rules import ruleset

    text = (ROOT / "docs" / "concepts" / "rule-files.md").read_text()  # the rule-file docs moved out of the README
    example = text.split("## The format", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "rules.toml"
    path.write_text(example)
    rules = ruleset([path])
    assert rules.token("my_query") == "q" and rules.family("MyLinear") == "linear"
    assert rules.fused_rule("attn_qkv").parts == ("q", "k", "v")
    assert rules.param_home("x.attn.qkv.norm_weight") == "x.attn_norm.weight"
    assert rules.is_sequence_first("mypackage.Model") and rules.labels_shifted("mypackage.Model")
    assert rules.bool_mask_means_masked("mypackage.Model") and "rope_angles" in rules.angles[0].angles
