"""``layerdiff logs diff``: parsers of real log layouts, alignment by iteration, tolerances, plots, CLI run()."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest

from layerdiff import logs
from layerdiff.errors import LayerdiffError

N = 12  # iterations per run


def run_values(drift_from=None, n=N):
    """{iteration: (loss, lr, grad_norm)}; loss 1% higher from iteration `drift_from` on."""
    out = {}
    for i in range(1, n + 1):
        loss = round(10.5 - 0.25 * i, 3)
        if drift_from is not None and i >= drift_from:
            loss = loss * 1.01
        out[i] = (loss, 1e-4 * min(1.0, i / 4), round(3.0 + 0.1 * i, 3))
    return out


def megatron_text(values, total=1000, skipped=()):
    lines = ["using world size: 8, data-parallel size: 1", "building GPT model ..."]
    for i, (loss, lr, gn) in values.items():
        lines.append(
            f" [2024-01-01 00:00:{i:02d}] iteration {i:>9d}/{total:>8d} | consumed samples: {64 * i:>12d} | "
            f"elapsed time per iteration (ms): 1234.5 | learning rate: {lr:.6E} | global batch size: {64:>5d} | "
            f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {gn:.3f} | "
            f"number of skipped iterations: {int(i in skipped):>3d} | number of nan iterations: {0:>3d} |")
        if i % 5 == 0:
            lines.append(f" validation loss at iteration {i} | lm loss value: 9.9E+00 | lm loss PPL: 1.9E+04 |")
    return "\n".join(lines) + "\n"


def mindspore_text(values, steps_per_epoch=100, bracket=True, sink=True, overflow=()):
    lines = ["2024-01-01 00:00:00,000 - mindformers[mindformers/trainer/base_trainer.py:100] - INFO - .........Build "
             "Network From Config.........."]
    for i, (loss, lr, gn) in values.items():
        epoch, step = (i - 1) // steps_per_epoch + 1, (i - 1) % steps_per_epoch + 1
        loss_txt = f"loss: {loss:5.3f}, " if sink else f"loss:[{loss:5.3f}/{loss + 0.5:5.3f}], "
        norm = f"[{gn}]" if bracket else f"{gn}"
        lr_txt = f"[{lr!r}]" if bracket and i % 2 else repr(lr)
        lines.append(
            f"2024-01-01 00:00:{i % 60:02d},123 - mindformers[mindformers/core/callback/callback.py:529] - INFO - "
            f"{{ Epoch:[{epoch:3d}/{3:3d}], step:[{step:5d}/{steps_per_epoch:5d}], {loss_txt}"
            f"per_step_time: 1234ms, lr: {lr_txt}, overflow cond: {i in overflow}, loss_scale: 1.0, "
            f"global_norm: {norm}, train_throughput_per_npu: 12.345T")
    return "\n".join(lines) + "\n"


def csv_text(values):
    rows = ["step,lm loss,learning rate,global_norm"]
    rows += [f"{i},{loss},{lr},{gn}" for i, (loss, lr, gn) in values.items()]
    return "\n".join(rows) + "\n"


def jsonl_text(values):
    return "".join(json.dumps({"iteration": i, "loss": loss, "lr": lr, "grad_norm": gn}) + "\n"
                   for i, (loss, lr, gn) in values.items())


WRITERS = {"megatron": megatron_text, "mindspore": mindspore_text, "csv": csv_text, "jsonl": jsonl_text}


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def diff_args(a, b, **kw):
    parser = argparse.ArgumentParser(prog="layerdiff")
    sub = parser.add_subparsers(dest="command")
    logs.register(sub, argparse.ArgumentParser)
    argv = ["logs", "diff", str(a), str(b), "-q"]
    for k, v in kw.items():
        if v is True:
            argv.append(f"--{k}")
        elif isinstance(v, list):
            for item in v:
                argv += [f"--{k}", item]
        else:
            argv += [f"--{k}", str(v)]
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_format_detected_from_content_and_values_parsed(tmp_path, fmt):
    values = run_values()
    path = write(tmp_path, "run.log.txt", WRITERS[fmt](values))  # extension says nothing
    got_fmt, data = logs.load_log(path)
    assert got_fmt == fmt
    assert sorted(data) == list(range(1, N + 1))
    for i, (loss, lr, gn) in values.items():
        assert data[i]["loss"] == pytest.approx(loss, rel=1e-6)
        assert data[i]["lr"] == pytest.approx(lr, rel=1e-6)
        assert data[i]["grad_norm"] == pytest.approx(gn, rel=1e-6)


def test_mindspore_iteration_across_epochs(tmp_path):
    values = run_values(n=25)
    path = write(tmp_path, "ms.log", mindspore_text(values, steps_per_epoch=10, sink=False, bracket=False))
    line = [ln for ln in path.read_text().splitlines() if "Epoch:[  3/" in ln and "step:[    4/" in ln]
    assert line, "layout: epoch 3 step 4 must exist"
    _, data = logs.load_log(path)
    assert sorted(data) == list(range(1, 26))  # (epoch - 1) * 10 + step
    assert data[24]["loss"] == pytest.approx(values[24][0])  # current loss of loss:[cur/avg], not the average
    assert data[24]["grad_norm"] == pytest.approx(values[24][2])


def test_megatron_vs_mindspore_same_numbers_identical(tmp_path):
    values = run_values()
    a = write(tmp_path, "megatron.log", megatron_text(values))
    b = write(tmp_path, "worker_0.log", mindspore_text(values))
    report = logs.compare_files(a, b)
    assert report["a"]["format"] == "Megatron-LM" and report["b"]["format"] == "MindSpore Transformers"
    assert report["compared"] == N
    assert report["verdict"] in ("identical", "within tolerance")
    assert all(r["first_over"] is None for r in report["metrics"].values())
    assert logs.run(diff_args(a, b)) == 0


def test_drift_detected_at_first_iteration(tmp_path, capsys):
    a = write(tmp_path, "a.log", megatron_text(run_values()))
    b = write(tmp_path, "b.log", mindspore_text(run_values(drift_from=7)))
    report = logs.compare_files(a, b)
    loss = report["metrics"]["loss"]
    assert report["verdict"] == "different"
    assert loss["first_over"] == 7 and loss["over"] == N - 6
    assert loss["max_rel"] == pytest.approx(0.01, rel=1e-2)
    assert report["metrics"]["lr"]["first_over"] is None and report["metrics"]["grad_norm"]["first_over"] is None
    assert logs.run(diff_args(a, b)) == 1
    assert "from iteration 7" in capsys.readouterr().out
    # a looser loss tolerance accepts the drift
    assert logs.run(diff_args(a, b, tol=["loss:rtol=2e-2,atol=0"])) == 0


def test_only_in_a_or_b_and_restart_override(tmp_path):
    va = run_values(n=12)
    vb = {i: v for i, v in run_values(n=15).items() if i >= 4}
    # B restarted from iteration 8: the first attempt's 8..10 were wrong, the re-logged ones count
    bad = {i: (v[0] * 2, v[1], v[2]) for i, v in vb.items() if 8 <= i <= 10}
    text = jsonl_text({**{i: v for i, v in vb.items() if i < 8}, **bad}) + jsonl_text(
        {i: v for i, v in vb.items() if i >= 8})
    a = write(tmp_path, "a.csv", csv_text(va))
    b = write(tmp_path, "b.jsonl", text)
    report = logs.compare_files(a, b)
    assert report["compared"] == 9
    assert report["only_a"] == {"count": 3, "ranges": [[1, 3]]}
    assert report["only_b"] == {"count": 3, "ranges": [[13, 15]]}
    assert report["verdict"] == "identical"


def test_skipped_iterations_are_nan(tmp_path):
    a = write(tmp_path, "a.log", megatron_text(run_values(), skipped={3}))
    b = write(tmp_path, "b.log", mindspore_text(run_values(), overflow={3}))
    _, data = logs.load_log(a)
    assert math.isnan(data[3]["loss"]) and math.isnan(data[3]["grad_norm"]) and data[3]["lr"] > 0
    assert logs.compare_files(a, b)["metrics"]["loss"]["first_over"] is None  # NaN vs NaN: same
    c = write(tmp_path, "c.log", megatron_text(run_values()))
    assert logs.compare_files(a, c)["metrics"]["loss"]["first_over"] == 3  # NaN vs number: over


def test_html_plot_and_json_refuse_overwrite(tmp_path):
    a = write(tmp_path, "a.log", megatron_text(run_values()))
    b = write(tmp_path, "b.log", mindspore_text(run_values(drift_from=7)))
    plot, js = tmp_path / "out.html", tmp_path / "out.json"
    assert logs.run(diff_args(a, b, plot=plot, json=js)) == 1
    page = plot.read_text()
    assert "<svg" in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert 'data-series="A: a.log"' in page and 'data-series="B: b.log"' in page
    assert "B - A" in page and "iteration" in page
    report = json.loads(js.read_text())
    assert report["metrics"]["loss"]["first_over"] == 7
    before = plot.read_text()
    with pytest.raises(LayerdiffError, match="exists"):
        logs.run(diff_args(a, b, plot=plot))
    with pytest.raises(LayerdiffError, match="exists"):
        logs.run(diff_args(a, b, json=js))
    assert plot.read_text() == before
    plot.write_text("old")
    assert logs.run(diff_args(a, b, plot=plot, json=js, force=True)) == 1
    assert "<svg" in plot.read_text()


def test_png_plot_and_unknown_suffix(tmp_path):
    a = write(tmp_path, "a.log", megatron_text(run_values()))
    assert logs.run(diff_args(a, a, plot=tmp_path / "p.png")) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(LayerdiffError, match=".html or .png"):
        logs.run(diff_args(a, a, plot=tmp_path / "p.pdf"))


def test_png_without_matplotlib_says_what_to_do(tmp_path):
    import subprocess
    import sys

    a = write(tmp_path, "a.log", megatron_text(run_values()))
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from layerdiff.cli import main\n"
            f"sys.exit(main(['logs', 'diff', r'{a}', r'{a}', '--plot', r'{tmp_path / 'p.png'}']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "matplotlib" in proc.stderr and ".html" in proc.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("content", [b"", b"hello world\nnothing to see\n", b"\x89HDF\r\n\x1a\n\0\0\0binary",
                                     b"a,b,c\n1,2,3\n", b'{"foo": 1}\n'])
def test_unrecognised_file_is_one_line_error(tmp_path, content):
    bad = tmp_path / "bad.log"
    bad.write_bytes(content)
    with pytest.raises(LayerdiffError) as exc:
        logs.load_log(bad)
    msg = str(exc.value)
    assert "\n" not in msg and str(bad) in msg
    assert "Megatron-LM, MindSpore Transformers, CSV or JSONL" in msg


@pytest.mark.parametrize("bad", ['{"iteration": 5, "loss": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                 '{"iteration": 5, "loss": 9.25,, "lr": 1e-4}',
                                 '{"iteration": 5, "loss": ' + "9" * 5000 + "}"],
                         ids=["nested_deeply", "not_json", "5000_digits"])
def test_a_jsonl_line_that_cannot_be_read_is_refused_naming_it(tmp_path, bad):
    """Before: the line was skipped, its iteration read as missing from one run, and ``logs diff`` said the runs
    differ (exit 1). A log still being written may end in a line cut short: that one is let go."""
    lines = jsonl_text(run_values()).splitlines()
    lines[4] = bad
    a = write(tmp_path, "a.jsonl", jsonl_text(run_values()))
    b = write(tmp_path, "b.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(LayerdiffError) as exc:
        logs.load_log(b)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"{b}: line 5: a JSON log line that cannot be read")
    with pytest.raises(LayerdiffError, match="line 5"):
        logs.run(diff_args(a, b))  # the CLI's logs diff: exit 2 (LayerdiffError), not 1 (different)
    torn = write(tmp_path, "torn.jsonl", jsonl_text(run_values()) + '{"iteration": 13, "lo')
    assert sorted(logs.load_log(torn)[1]) == list(range(1, N + 1))


@pytest.mark.slow
def test_cli_logs_diff_refuses_a_nested_jsonl_line_with_one_line_and_exit_2(tmp_path):
    lines = jsonl_text(run_values()).splitlines()
    lines[4] = '{"iteration": 5, "loss": ' + "[" * 100_000 + "]" * 100_000 + "}"
    a = write(tmp_path, "a.jsonl", jsonl_text(run_values()))
    b = write(tmp_path, "b.jsonl", "\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "layerdiff", "logs", "diff", str(a), str(b)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "line 5" in proc.stderr, proc.stderr
    assert "nested too deeply" in proc.stderr


def test_missing_file_and_bad_tolerance(tmp_path):
    a = write(tmp_path, "a.log", megatron_text(run_values()))
    with pytest.raises(LayerdiffError, match="no such file"):
        logs.run(diff_args(a, tmp_path / "nope.log"))
    for bad in ["loss", "speed:rtol=1", "loss:rtol=x", "loss:btol=1", "loss:rtol=-1"]:
        with pytest.raises(LayerdiffError, match="bad tolerance"):
            logs.run(diff_args(a, a, tol=[bad]))


def test_no_common_iteration(tmp_path):
    a = write(tmp_path, "a.jsonl", jsonl_text({i: v for i, v in run_values().items() if i <= 5}))
    b = write(tmp_path, "b.jsonl", jsonl_text({i: v for i, v in run_values().items() if i > 5}))
    with pytest.raises(LayerdiffError, match="share no iteration"):
        logs.compare_files(a, b)


def test_diff_api_and_tolerance_parsing():
    a = {1: {"loss": 10.0, "lr": 1e-4, "grad_norm": None}, 2: {"loss": 9.0, "lr": 1e-4, "grad_norm": None}}
    b = {1: {"loss": 10.0, "lr": 1e-4, "grad_norm": 2.0}, 2: {"loss": 9.008, "lr": 1e-4, "grad_norm": 2.0}}
    r = logs.diff(a, b)
    assert r["metrics"]["loss"]["verdict"] == "within tolerance"  # < 1e-3 relative, the default
    assert r["metrics"]["grad_norm"]["verdict"] == "not compared"
    r = logs.diff(a, b, logs.parse_tolerance("loss:rtol=1e-4"))
    assert r["metrics"]["loss"]["first_over"] == 2 and r["verdict"] == "different"


def test_full_render_and_subprocess(tmp_path):
    a = write(tmp_path, "a.log", megatron_text(run_values()))
    b = write(tmp_path, "b.log", mindspore_text(run_values(drift_from=7)))
    code = ("import sys; from layerdiff.logs import compare_files, render; r = compare_files(sys.argv[1], sys.argv[2]);"
            " render(r); sys.exit(0 if r['verdict'] != 'different' else 1)")
    proc = subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    for word in ("loss", "grad_norm", "first over tolerance", "different", "Megatron-LM", "MindSpore"):
        assert word in proc.stdout


def test_nonfinite_mismatch_counted_apart():
    a = {1: {"loss": 10.0, "lr": None, "grad_norm": None}, 2: {"loss": math.nan, "lr": None, "grad_norm": None},
         3: {"loss": 8.0, "lr": None, "grad_norm": None}}
    b = {1: {"loss": 10.0, "lr": None, "grad_norm": None}, 2: {"loss": 9.0, "lr": None, "grad_norm": None},
         3: {"loss": 8.004, "lr": None, "grad_norm": None}}
    r = logs.diff(a, b)["metrics"]["loss"]
    assert r["nonfinite_mismatch"] == 1 and r["first_over"] == 2 and r["over"] == 1
    assert r["max_abs"] == pytest.approx(0.004) and r["max_abs_at"] == 3


def test_html_plot_ticks_each_iteration_once(tmp_path):
    import re

    from layerdiff import logs

    for name, values in (("a", [5.0, 4.0, 3.5, 3.2]), ("b", [5.0, 4.1, 3.5, 3.2])):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            f'{{"iteration": {i}, "loss": {v}}}\n' for i, v in enumerate(values, 1)))
    report = logs.diff(logs.load_log(tmp_path / "a.jsonl")[1], logs.load_log(tmp_path / "b.jsonl")[1])
    page = logs.render_html(report, "a", "b")
    ticks = re.findall(r'text-anchor="middle">(\d+)</text>', page)
    assert ticks[:4] == ["1", "2", "3", "4"]  # not "1 2 2 3 4"
