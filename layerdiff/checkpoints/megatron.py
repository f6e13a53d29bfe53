"""Megatron-LM checkpoint folders: tensor- and pipeline-parallel shards merged into one name -> tensor view."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from layerdiff.checkpoints.formats import Checkpoint, InMemory, flatten, torch_load, torch_stored
from layerdiff.checkpoints.torch_dcp import DistCheckpoint, is_dist_checkpoint
from layerdiff.errors import LayerdiffError


def megatron_globals() -> tuple:
    """What Megatron's model_optim_rng.pt pickles besides tensors: its ``args`` (argparse.Namespace) and the
    numpy RNG state (arrays rebuilt by numpy's reconstruct helper). Allowed only for these files, only for
    that load; none of them runs user code."""
    import numpy.core.multiarray as multiarray

    reconstruct = multiarray._reconstruct  # type: ignore[attr-defined]  # numpy's private pickling helper
    return (argparse.Namespace, reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32")))


_REPLICATED_HINT = re.compile(r"norm", re.I)
_COLUMN = re.compile(r"(^|\.)(query_key_value|linear_qkv|qkv|dense_h_to_4h|linear_fc1|fc1|word_embeddings|"
                     r"output_layer|q_proj|k_proj|v_proj|gate_proj|up_proj|lm_head)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)(dense|linear_proj|proj|dense_4h_to_h|linear_fc2|fc2|o_proj|down_proj)\.weight$")
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")


def megatron_partition_dim(name: str):
    """0 for column-parallel, 1 for row-parallel weights, None for replicated (taken from TP rank 0)."""
    leaf = name.rpartition(".")[2]
    if _REPLICATED_HINT.search(leaf):
        return None
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def _megatron_iter_dir(path: Path) -> Path:
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        try:
            with open(tracker, "rb") as f:
                text = f.read(100).decode("utf-8", errors="replace").strip()
        except OSError as exc:
            raise LayerdiffError(f"{tracker}: cannot read ({exc.strerror or exc})") from None
        if text == "release":
            sub = path / "release"
        elif re.fullmatch(r"[0-9]{1,12}", text):
            sub = path / f"iter_{int(text):07d}"
        else:
            raise LayerdiffError(f"{tracker}: expected an iteration number, found {text[:40]!r}")
        if not sub.is_dir():
            raise LayerdiffError(f"{tracker} names {sub.name}, which does not exist")
        return sub
    return path


def is_megatron(path: Path) -> bool:
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return True
    return any(_RANK_DIR.match(p.name) and p.is_dir() for p in path.iterdir())


def megatron_args(path) -> dict:
    """The training arguments a Megatron-LM checkpoint stores (``args``, an argparse.Namespace), as a dict with
    Megatron's underscore names; from a checkpoint directory (its latest iteration: the first rank's file, or
    ``common.pt`` of the torch_dist format) or one ``model_optim_rng.pt``. Loaded with ``weights_only`` and only
    Megatron's own extra types admitted."""
    path = Path(path)
    if path.is_dir():
        it = _megatron_iter_dir(path)
        files = sorted(f for d in sorted(it.iterdir()) if _RANK_DIR.match(d.name) and d.is_dir()
                       for f in d.glob("*.pt"))
        if not files and (it / "common.pt").is_file():  # torch_dist: what is not sharded is in common.pt
            files = [it / "common.pt"]
        if not files:
            raise LayerdiffError(f"{path}: no mp_rank_XX/*.pt or common.pt file (not a Megatron checkpoint)")
        path = files[0]
    state, _ = torch_load(path, megatron_globals())
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise LayerdiffError(f"{path}: holds no Megatron args (a checkpoint saved without them?)")
    return {k: v for k, v in vars(args).items() if isinstance(k, str)}


def load_megatron(path: Path) -> Checkpoint:
    import torch
    it = _megatron_iter_dir(path)
    if is_dist_checkpoint(it):  # Megatron-core's torch_dist format (its default): one folder for every rank
        return DistCheckpoint(it)
    ranks = {}
    for d in sorted(it.iterdir()):
        m = _RANK_DIR.match(d.name)
        if m and d.is_dir():
            ranks[(int(m.group(2) or 0), int(m.group(1)))] = d  # (pp, tp)
    if not ranks:
        raise LayerdiffError(f"{it}: no mp_rank_XX folders (not a Megatron checkpoint iteration)")
    pps = sorted({pp for pp, _ in ranks})
    tps = sorted({tp for _, tp in ranks})
    for pp in pps:
        have = sorted(tp for p, tp in ranks if p == pp)
        if have != list(range(len(have))) or len(have) != len(tps):
            raise LayerdiffError(f"{it}: tensor-parallel ranks of pipeline rank {pp} are incomplete: {have}")
    if pps != list(range(len(pps))):
        raise LayerdiffError(f"{it}: pipeline ranks are incomplete: {pps}")
    merged, layer_offset = {}, 0
    for pp in pps:
        states = []
        for tp in tps:
            d = ranks[(pp, tp)]
            files = sorted(d.glob("*.pt"))
            if not files:
                raise LayerdiffError(f"{d}: no .pt file")
            file = d / "model_optim_rng.pt" if (d / "model_optim_rng.pt").is_file() else files[0]
            obj, _ = torch_load(file, extra_globals=megatron_globals())
            if not isinstance(obj, dict):
                raise LayerdiffError(f"{file}: not a Megatron checkpoint (not a dict)")
            models = sorted(k for k in obj if re.fullmatch(r"model\d*", str(k)))
            if not models:
                raise LayerdiffError(f"{file}: no 'model' entry (not a Megatron checkpoint)")
            flat = {}
            for key in models:
                part: dict = {}
                flatten(obj[key], "", part, lambda x: isinstance(x, torch.Tensor), [], source=file)
                prefix = f"{key}." if len(models) > 1 else ""
                flat.update({prefix + k: v for k, v in part.items()})
            states.append((file, flat))
            del obj
        names0 = list(states[0][1])
        for file, flat in states[1:]:
            if set(flat) != set(names0):
                diff_names = sorted(set(flat) ^ set(names0))[:3]
                raise LayerdiffError(f"{file}: parameter names differ from TP rank 0 (e.g. {diff_names})")
        local_layers = 0
        for name in names0:
            dim = megatron_partition_dim(name)
            parts = [flat[name] for _, flat in states]
            if dim is not None and parts[0].dim() > dim:
                try:
                    value = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
                except RuntimeError:
                    raise LayerdiffError(f"{it}: the TP shards of {name!r} cannot be joined on dim {dim} (shapes "
                                         f"{[list(p.shape) for p in parts][:4]})") from None
            else:
                if any(p.shape != parts[0].shape for p in parts[1:]):
                    raise LayerdiffError(f"{it}: {name!r} has different shapes on TP ranks but no partition "
                                         "rule (see megatron_partition_dim)")
                value = parts[0]
            m = _LAYER.search(name)
            if m and len(m.group(2)) > 9:
                raise LayerdiffError(f"{it}: layer number of {name[:120]!r} is implausibly large")
            if m:
                local_layers = max(local_layers, int(m.group(2)) + 1)
                name = name[:m.start(2)] + str(int(m.group(2)) + layer_offset) + name[m.end(2):]
            if name in merged:
                continue  # e.g. tied embeddings on first and last stage: keep the first
            stored = torch_stored(value)
            merged[name] = (np.array(stored[0], copy=True), stored[1])
        layer_offset += local_layers
        del states
    ck = InMemory(it, "megatron", merged)
    ck.notes.append(f"merged TP={len(tps)} x PP={len(pps)} from {it.name}")
    return ck


