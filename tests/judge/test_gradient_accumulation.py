"""Gradient accumulation declared with ``Tracer.step()``: a step of microbatches against one process that took the
whole batch at once (transformers' Llama from a config, two SGD steps).

The microbatches of a step join along the batch axis; the loss is the sum of each microbatch's loss weighted by the
gradient its backward started from (1/M where the training loop divides by the number of microbatches, 1 where
each loss is its share of the batch's mean already: transformers' ``num_items_in_batch``), and that sum's gradient
is 1, as the whole batch's is. So the loop that forgets to divide, and the loop that averages per-microbatch means
over microbatches with unequal numbers of labelled tokens (the bug transformers fixed in 4.46), are named at the
loss; the loops that do it right align."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.errors import LayerdiffError  # noqa: E402
from layerdiff.recipes import llama_shared as shared  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

from conftest import align_files  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced


def _run(path, loop: str, padded: bool, mode: str = "full"):
    model, cfg = torch_llama.build_model()
    ids = torch.from_numpy(shared.input_ids(cfg, 4, 16, 0))
    labels = ids.clone()
    if padded:  # the first sequence has 3 labelled tokens, the others 15: unequal microbatches
        labels[0, 4:] = -100
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with layerdiff.trace(model, path, mode=mode) as tracer:
        for _ in range(2):
            optimizer.zero_grad()
            if loop == "whole":
                model(input_ids=ids, labels=labels).loss.backward()
            else:
                with tracer.step():
                    items = int((labels[:, 1:] != -100).sum())
                    for i in range(2):
                        extra = {"num_items_in_batch": items} if loop == "items" else {}
                        loss = model(input_ids=ids[2 * i:2 * i + 2], labels=labels[2 * i:2 * i + 2], **extra).loss
                        (loss / 2 if loop == "mean" else loss).backward()
            optimizer.step()
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("accumulation")
    runs = {(loop, padded, mode): _run(root / f"{loop}_{padded}_{mode}.h5", loop, padded, mode)
            for loop, padded, mode in (("whole", False, "full"), ("mean", False, "full"), ("sum", False, "full"),
                                       ("whole", True, "full"), ("mean", True, "full"), ("items", True, "full"),
                                       ("whole", False, "stats"), ("mean", False, "stats"))}
    return runs


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_microbatches_divided_by_their_number_align_with_the_whole_batch(traces, mode):
    report = align_files(traces[("whole", False, mode)], traces[("mean", False, mode)])
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["compared"] == 42 and report["params"]["grads_compared"] == 42
    root = next(r for r in report["records"] if r["path"] == "" and r["phase"] == "forward")
    loss = next(t for t in root["tensors"] if t["key"] == "out.loss")
    assert loss["metrics"]["note"] == "B: 2 microbatches added up, x0.5"


def test_losses_of_a_shared_mean_align_with_unequal_microbatches(traces):
    """``num_items_in_batch``: each microbatch's loss is its share of the batch's mean; backward from each as it is."""
    report = align_files(traces[("whole", True, "full")], traces[("items", True, "full")])
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])


@pytest.mark.parametrize("case", [("sum", False), ("mean", True)])
def test_a_wrong_accumulation_is_named_at_the_loss(traces, case):
    """Undivided losses (twice the gradients), and means of unequal microbatches averaged (the batch's tokens
    weighted unequally): the model's layers agree, its loss does not."""
    loop, padded = case
    report = align_files(traces[("whole", padded, "full")], traces[(loop, padded, "full")])
    origin = report["forward"]["first_divergence"]
    assert (origin["module"], origin["where"], origin["step"]) == ("", "own_code", 0), origin
    assert origin["tensor"]["key"] == "out.loss" and origin["between"][0] == "lm_head"


def test_declared_steps_are_refused_outside_a_trace_and_nested(tmp_path):
    model, _ = torch_llama.build_model()
    tracer = layerdiff.trace(model, tmp_path / "t.h5")
    with pytest.raises(LayerdiffError, match="not open"):
        with tracer.step():
            pass
    with tracer:
        with tracer.step():
            with pytest.raises(LayerdiffError, match="do not nest"):
                with tracer.step():
                    pass
