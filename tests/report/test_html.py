"""``layerdiff align A B --html``: one self-contained page (no script, no network) that shows the origin with its
explanation, the error-growth plot and the module tree; checked as HTML and, where Chromium is installed, as
what a real headless browser renders."""
from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser

import pytest

pytest.importorskip("torch")

from conftest import run_cli  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ORIGIN = "model.layers.1.post_attention_layernorm"


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.urls, self.text, self.ids = [], [], [], {}
        self._stack = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href") and v]
        if "id" in attrs:
            self.ids[attrs["id"]] = len(self.text)

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def page(recipe_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("html") / "report.html"
    code, _, err = run_cli("align", recipe_trace(), recipe_trace("eps"), "--html", out, "-q")
    assert code == 1, err
    return out


def test_the_page_is_self_contained_and_names_the_origin(page):
    parsed = _Page()
    parsed.feed(page.read_text())
    assert "script" not in parsed.tags and not parsed.urls  # nothing to run, nothing to fetch
    text = " ".join("".join(parsed.text).split())
    assert f"origin: {ORIGIN} (LlamaRMSNorm)" in text and "eps: 1e-06 (A) vs 1e-05 (B)" in text
    assert "forward-origin" in parsed.ids and "svg" in parsed.tags and "polyline" in parsed.tags
    assert "out.logits" in text  # per-tensor metrics are in the page (folded)
    code, _, err = run_cli("align", page, page, "--html", page)  # never over a file without --force
    assert code == 2 and "exists" in err


def test_a_real_browser_renders_the_origin_and_the_plot(page, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium): the page was not rendered")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    rendered = _Page()
    rendered.feed(dom)
    text = " ".join("".join(rendered.text).split())
    assert f"origin: {ORIGIN}" in text and "layerdiff: divergent" in text
    assert "polyline" in rendered.tags and "circle" in rendered.tags
    shot = tmp_path / "page.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()], capture_output=True,
                   timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000  # a page with content, not a blank image


def test_an_operation_origin_shows_both_runs_lines_of_code(tmp_path):
    """With operations recorded: the origin's line in each run, its code, and the module's operations side by
    side; also as a real browser renders it."""
    import layerdiff
    from layerdiff.recipes import torch_llama_ops as recipe

    for name, defect in (("ref", None), ("bad", "helper")):
        built = recipe.build(defect)
        with layerdiff.trace(built["model"], tmp_path / f"{name}.h5", ops=True):
            built["step"]()
    out = tmp_path / "ops.html"
    layerdiff.align(tmp_path / "ref.h5", tmp_path / "bad.h5").to_html(out)
    parsed = _Page()
    parsed.feed(out.read_text())
    text = " ".join("".join(parsed.text).split())
    assert "return torch.cat((x2, -x1), dim=-1) # defect: helper" in text  # B's line of code, read from the file
    assert "return torch.cat((-x2, x1), dim=-1)" in text  # A's
    assert "Operations of model.layers.1.self_attn (forward), A | B" in text and "← origin" in text
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium): the page was not rendered")
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", out.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    rendered = _Page()
    rendered.feed(dom)
    assert "Operations of model.layers.1.self_attn" in " ".join("".join(rendered.text).split())


def test_nan_in_one_run_is_plotted_and_a_tree_says_what_differs_inside(recipe_trace, tmp_path):
    """A NaN born in the candidate: the plot drew nothing ('no tensor differs': every finite metric agrees) and the
    backward tree's root said 'ok' (the loss's gradient is 1) over 79 tensors that differ. NaN/Inf in one run only
    get a row of their own above the scale, and a call whose own tensors agree says when one inside it differs."""
    out = tmp_path / "nan.html"
    code, _, err = run_cli("align", recipe_trace(), recipe_trace("nan"), "--html", out, "-q")
    assert code == 1, err
    html = out.read_text()
    plot = html[html.index("<svg"):html.index("</svg>")]
    assert ">NaN/Inf</text>" in plot and "model.layers.1.mlp.gate_proj: NaN/Inf in one run only" in plot
    tree = html[html.index("Module tree (backward)"):]
    parsed = _Page()
    parsed.feed(tree)
    text = " ".join(" ".join(parsed.text).split())
    assert text.startswith("Module tree (backward) <root> LlamaForCausalLM differs inside"), text[:200]
