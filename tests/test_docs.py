"""The documentation stays true: the site builds with mkdocs --strict (a broken link or anchor fails), every page is
in its nav, the README's and CONTRIBUTING's links point at files that exist, and the JSON report reference is what
the report's declarations give."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_report_reference_is_generated_from_the_declarations():
    done = subprocess.run([sys.executable, "tools/report_reference.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr + done.stdout[-3000:]


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it comes with the test extra: pip install -e '.[test]')")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "report" / "index.html").exists()


def _nav_pages(nav):
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from _nav_pages(value)
        else:
            yield value


def test_every_page_is_in_the_nav():
    yaml = pytest.importorskip("yaml")
    nav = set(_nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    docs = ROOT / "docs"
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md") if p.relative_to(docs).parts[0] != "benchmarks"}
    assert pages <= nav, sorted(pages - nav)
    assert not {p for p in nav if not (docs / p).exists()}, "the nav names pages that do not exist"


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_relative_links_point_at_files(name):
    text = (ROOT / name).read_text()
    links = [target.split("#", 1)[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)]
    local = [link for link in links if link and not re.match(r"[a-z]+:", link)]
    assert local, f"{name} links to no page of the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200  # the rest lives in docs/
