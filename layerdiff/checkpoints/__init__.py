"""Checkpoint-to-checkpoint weight comparison: ``layerdiff weights diff A B``.

Modules: ``formats`` (one reader per format), ``megatron`` (merging a Megatron-LM folder's shards), ``open``
(choosing the reader), ``compare`` (the per-parameter report), ``cli`` (the command).

``open_checkpoint(path)`` returns a ``Checkpoint`` with ``names()``, ``info(name) -> (dtype, shape)`` and
``load(name) -> (numpy array of stored bits, dtype name)`` (bfloat16/float8 travel as their bits, as everywhere
in layerdiff). ``diff(a, b)`` compares two of them parameter by parameter; ``run(args)`` is the CLI command.

Formats and how they are read (framework libraries are imported only by the loader that needs them):

- ``.safetensors`` and Hugging Face folders (``model.safetensors``, ``model.safetensors.index.json`` shards):
  streamed, one tensor at a time, by offsets from the validated header. Nothing is unpickled.
- ``.npz``: ``np.load(allow_pickle=False)``; members are read lazily, one at a time.
- layerdiff trace ``.h5``: its ``param`` records (the values at step 0, or at the last step with
  ``param_step="last"``), read one tensor at a time.
- PyTorch ``.pt``/``.bin`` (and ``pytorch_model.bin`` folders): ``torch.load(weights_only=True)`` with
  ``mmap=True`` where the file is a zip checkpoint (then tensors are paged in on use, not held in memory);
  legacy (non-zip) files are loaded whole. A pickle that needs anything beyond tensors and plain containers
  is refused (never re-loaded unsafely). Nested dicts (``{"model": state_dict}``) are flattened with dots.
- Paddle ``.pdparams``: these are *pickles*, and ``paddle.load`` unpickles them with the stock unpickler, so
  a malicious file would run code. We therefore never call ``paddle.load``: a restricted unpickler accepts
  only dicts/OrderedDicts of numpy arrays (numpy's array-reconstruction globals), refusing any other global.
  Loaded whole. Paddle saves bfloat16 as uint16 arrays, so such tensors show as uint16.
- MindSpore ``.ckpt``: ``mindspore.load_checkpoint`` (protobuf, not pickle), loaded whole.
- Megatron-LM folders: a root holding ``latest_checkpointed_iteration.txt`` (that iteration is used) or an
  ``iter_XXXXXXX`` folder, with ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files. Read with
  ``weights_only=True`` (``argparse.Namespace`` and numpy's array rebuild allowed, for Megatron's stored
  ``args`` and numpy RNG state; anything else, e.g. TransformerEngine extra state objects, is refused with a
  clear message). The model
  state is ``"model"`` (or ``"model0"``, ``"model1"``... for virtual pipeline stages, prefixed ``model0.``...).
  Merging (see ``megatron_partition_dim``): tensor-parallel shards are concatenated by parameter name:
  column-parallel (qkv / linear_qkv / query_key_value, fc1 / dense_h_to_4h / linear_fc1, word_embeddings,
  output_layer, q/k/v/gate/up_proj, lm_head: weight *and* bias) on dim 0; row-parallel (self_attention.dense
  / linear_proj / proj, fc2 / dense_4h_to_h / linear_fc2, o_proj, down_proj: weight only) on dim 1;
  everything else (norms, biases of row-parallel layers, rotary buffers...) is replicated and taken from
  TP rank 0. Anything whose name contains "norm" is replicated. Pipeline ranks hold different layers with
  local indices, so ``layers.N`` of PP rank p is renumbered by the layer count of ranks < p; other names found
  on several PP ranks (tied embeddings) are taken from the first. Note: a GLU fc1 ([gate; up] per rank) merges
  as [g0; u0; g1; u1], which matches another checkpoint of the same TP size, not a TP=1 one.
- Distributed checkpoint folders (``.metadata`` + ``*.distcp``): Megatron-core's ``torch_dist`` format (also
  found through ``latest_checkpointed_iteration.txt``) and FSDP / torchtitan checkpoints; see ``torch_dcp``.
  Tensors are joined from every rank's chunks by their global offsets (Megatron's GLU fc1 comes out as
  [gate; up], as a TP=1 model holds it), Megatron's stacked layers are split into ``layers.N``, optimizer state
  is left out. Nothing is unpickled beyond PyTorch's metadata classes and ``weights_only`` tensors.

Memory: streamed formats never hold a whole checkpoint. Whole-loaded formats (legacy torch, pdparams,
MindSpore, Megatron's per-rank files when not mmap-able) hold one checkpoint at a time: when *both* sides are
whole-loaded, ``diff`` spills side A to a temporary safetensors file and frees it before loading B.

Security: checkpoints from untrusted sources should be verified first (``file_digest``, ``--sha256``).
"""
from layerdiff.checkpoints.cli import register, run
from layerdiff.checkpoints.compare import compare_files, diff
from layerdiff.checkpoints.formats import Checkpoint, file_digest
from layerdiff.checkpoints.megatron import megatron_args, megatron_partition_dim
from layerdiff.checkpoints.open import open_checkpoint, torch_layout_state

__all__ = ["Checkpoint", "compare_files", "diff", "file_digest", "megatron_args", "megatron_partition_dim",
           "open_checkpoint", "register", "run", "torch_layout_state"]
