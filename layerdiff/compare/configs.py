"""Model configurations aligned across frameworks: the first step of a port ("configuration alignment").

A Megatron-LM launch script, a MindSpore Transformers YAML and a Hugging Face / PaddleFormers ``config.json``
name the same hyper-parameters differently (``--num-layers``, ``num_layers``, ``num_hidden_layers``) and some
with inverted or combined meanings (``--disable-bias-linear`` vs ``add_bias_linear``; ``--swiglu`` vs
``hidden_act: silu`` in a gated MLP). Each file is read into canonical keys (``CanonicalConfig``), with the
defaults its framework applies to keys it leaves out, and two canonical configs are compared.
"""
from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from layerdiff.errors import LayerdiffError

# canonical key -> names in a Megatron-LM command line (dashes), in MindSpore Transformers YAML, in HF config.json
ALIASES = {
    "num_layers": (("num-layers",), ("num_layers",), ("num_hidden_layers", "n_layer", "num_layers")),
    "hidden_size": (("hidden-size",), ("hidden_size",), ("hidden_size", "n_embd", "d_model")),
    "ffn_hidden_size": (("ffn-hidden-size",), ("intermediate_size", "ffn_hidden_size"),
                        ("intermediate_size", "n_inner", "d_ff")),
    "num_attention_heads": (("num-attention-heads",), ("num_heads", "num_attention_heads"),
                            ("num_attention_heads", "n_head")),
    "num_query_groups": (("num-query-groups",), ("n_kv_heads", "num_query_groups"), ("num_key_value_heads",)),
    "head_dim": (("kv-channels",), ("head_dim", "kv_channels"), ("head_dim",)),
    "vocab_size": (("vocab-size", "padded-vocab-size"), ("vocab_size",), ("vocab_size",)),
    "max_position_embeddings": (("max-position-embeddings",), ("max_position_embeddings", "max_position_embedding"),
                                ("max_position_embeddings", "n_positions")),
    "seq_length": (("seq-length",), ("seq_length",), ()),
    "norm_epsilon": (("norm-epsilon", "layernorm-epsilon"), ("rms_norm_eps", "layernorm_epsilon", "norm_epsilon"),
                     ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")),
    "normalization": (("normalization",), ("normalization",), ()),
    "position_embedding_type": (("position-embedding-type",), ("position_embedding_type",), ()),
    "rotary_base": (("rotary-base",), ("rotary_base", "theta", "rope_theta"), ("rope_theta",)),
    "rotary_percent": (("rotary-percent",), ("rotary_percent",), ("partial_rotary_factor",)),
    "rotary_interleaved": (("rotary-interleaved",), ("rotary_interleaved",), ()),
    "add_bias_linear": ((), ("add_bias_linear",), ()),
    "add_qkv_bias": (("add-qkv-bias",), ("qkv_has_bias", "add_qkv_bias"), ()),
    "activation": ((), (), ()),
    "tie_embeddings": ((), (), ("tie_word_embeddings",)),
    "init_method_std": (("init-method-std",), ("init_method_std",), ("initializer_range",)),
    "attention_dropout": (("attention-dropout",), ("attention_dropout",), ("attention_dropout", "attn_pdrop")),
    "hidden_dropout": (("hidden-dropout",), ("hidden_dropout",), ("hidden_dropout", "resid_pdrop")),
    "apply_residual_connection_post_layernorm": (("apply-residual-connection-post-layernorm",),
                                                 ("apply_residual_connection_post_layernorm",), ()),
    "qk_layernorm": (("qk-layernorm",), ("qk_layernorm",), ()),
    "num_experts": (("num-experts",), ("num_experts", "expert_num"), ("num_local_experts", "num_experts")),
    "moe_router_topk": (("moe-router-topk",), ("moe_router_topk", "num_experts_chosen"), ("num_experts_per_tok",)),
}
_KIND_INDEX = {"megatron": 0, "mindformers": 1, "hf": 2}
# Megatron-LM flags whose presence sets a canonical key (the rest of its keys are read by ALIASES)
_MEGATRON_FLAGS = ("disable-bias-linear", "swiglu", "squared-relu", "openai-gelu", "untie-embeddings-and-output-weights",
                   "group-query-attention", "add-qkv-bias", "qk-layernorm", "rotary-interleaved",
                   "apply-residual-connection-post-layernorm", "use-rotary-position-embeddings")
# Hugging Face model types whose MLP is gated (act(gate) * up): hidden_act "silu" there means SwiGLU
_GATED_HF = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3",
             "phi3", "olmo", "olmo2", "deepseek_v2", "deepseek_v3", "internlm2", "baichuan", "yi", "granite", "cohere"}
_HF_QKV_BIAS = {"qwen2", "qwen2_moe"}
_MAX_FILE = 16 << 20


@dataclass
class CanonicalConfig:
    """A configuration in canonical keys. ``names`` says what the file called each key (for the report),
    ``defaulted`` which keys its framework's defaults filled in, ``unmapped`` the file's keys with no canonical
    counterpart. A key ``derived`` from another one is not reported again when only that other one differs."""

    path: str
    kind: str
    values: dict = field(default_factory=dict)
    names: dict = field(default_factory=dict)
    defaulted: set = field(default_factory=set)
    derived: dict = field(default_factory=dict)  # key -> the key its default follows (qkv bias from linear bias)
    unmapped: list = field(default_factory=list)


def read_config(path) -> CanonicalConfig:
    """A Megatron-LM launch script or args file (``--num-layers 24 ...``) or YAML (``--yaml-cfg``: one with a
    ``language_model`` section), a MindSpore Transformers YAML, or an HF / PaddleFormers ``config.json``; anything
    else is one ``LayerdiffError``."""
    path = Path(path)
    try:
        if path.stat().st_size > _MAX_FILE:
            raise LayerdiffError(f"{path}: over {_MAX_FILE >> 20} MB, not a configuration")
        text = path.read_text()
    except FileNotFoundError:
        raise LayerdiffError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LayerdiffError(f"{path}: is a directory; name the config file (config.json, a .yaml, a .sh)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LayerdiffError(f"{path}: cannot read it as text ({type(exc).__name__})") from None
    if path.suffix in (".yaml", ".yml"):
        data = _yaml(path, text)
        if isinstance(data.get("language_model"), dict):  # Megatron-LM's --yaml-cfg
            return _from_megatron_yaml(path, data)
        return _from_mindformers(path, data)
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise LayerdiffError(f"{path}: not valid JSON") from None
        if not isinstance(data, dict):
            raise LayerdiffError(f"{path}: JSON, but not a configuration (not an object)")
        if any(k in data for k in ("model_type", "architectures", "num_hidden_layers", "n_layer")):
            return _from_hf(path, data)
        return _from_megatron(path, {k.replace("_", "-"): v for k, v in data.items()})
    if "--" in text:
        return _from_megatron(path, _command_line_args(text))
    raise LayerdiffError(f"{path}: not a configuration layerdiff reads (a Megatron-LM launch script with --flags, a "
                         ".yaml of MindSpore Transformers, or an HF config.json)")


def from_megatron_args(args: dict, source: str) -> CanonicalConfig:
    """The ``args`` a Megatron-LM checkpoint stores (underscore names, every default filled in by argparse)."""
    flags = {k.replace("_", "-"): v for k, v in args.items()}
    if "add-bias-linear" in flags:  # --disable-bias-linear stores add_bias_linear=False
        flags["disable-bias-linear"] = not flags.pop("add-bias-linear")
    for name in _MEGATRON_FLAGS:  # stored as booleans: a False flag is an absent one
        if flags.get(name) is False:
            del flags[name]
    return _from_megatron(Path(source), flags)


def _from_megatron_yaml(path: Path, data: dict) -> CanonicalConfig:
    """A Megatron-LM YAML (``--yaml-cfg``): the arguments at its top level, the model's in ``language_model``
    (named as ``TransformerConfig`` names them), ``model_parallel`` and the like set aside; null is "not set", as
    an absent flag."""
    args = {k: v for k, v in data.items() if not isinstance(v, dict)}
    args.update(data["language_model"])
    if "num_moe_experts" in args:  # TransformerConfig's name for --num-experts
        args.setdefault("num_experts", args.pop("num_moe_experts"))
    if str(args.get("activation_func", "")).lower() == "swiglu":  # the model's own spelling of --swiglu
        args["swiglu"] = True
        del args["activation_func"]
        args.pop("gated_linear_unit", None)  # what swiglu is
    return from_megatron_args({k: v for k, v in args.items() if v is not None}, str(path))


def from_values(values: dict, kind: str, source: str = "trace") -> CanonicalConfig:
    """A configuration held in memory: ``kind`` "hf" (a ``PretrainedConfig.to_dict()``) or "mcore"
    (Megatron-core / MindSpore Transformers names, e.g. a ``TransformerConfig``)."""
    if kind == "hf":
        return _from_hf(Path(source), values)
    return _from_mindformers(Path(source), values)


def _yaml(path: Path, text: str) -> dict:
    try:
        import yaml
    except ImportError:
        raise LayerdiffError("reading YAML needs PyYAML: pip install pyyaml") from None
    try:
        data = yaml.safe_load(text)  # safe_load: no Python objects from a user's file
    except (yaml.YAMLError, RecursionError) as exc:
        raise LayerdiffError(f"{path}: not valid YAML ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise LayerdiffError(f"{path}: YAML, but not a configuration (not a mapping)")
    return data


def _command_line_args(text: str) -> dict:
    """``--key value`` and ``--flag`` pairs of a shell script, with its simple ``NAME=value`` variables
    substituted; a later occurrence of a key wins, as in argparse."""
    text = re.sub(r"\\\n", " ", text)
    variables = dict(re.findall(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=([^\s(]\S*)\s*$", text, flags=re.M))
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        tokens = text.split()
    substitute = lambda t: re.sub(r"\$\{?([A-Za-z_]\w*)\}?",  # noqa: E731
                                  lambda m: variables.get(m.group(1), m.group(0)).strip("\"'"), t)
    tokens = [substitute(t) for t in tokens]
    args: dict = {}
    for i, token in enumerate(tokens):
        if not token.startswith("--") or len(token) < 3:
            continue
        key, eq, value = token[2:].partition("=")
        if eq:
            args[key] = value
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--") and tokens[i + 1] not in ("(", ")") \
                and key not in _MEGATRON_FLAGS:
            args[key] = tokens[i + 1]
        else:
            args[key] = True
    return args


def _number(value):
    if isinstance(value, str):
        for conv in (int, float):
            try:
                return conv(value)
            except ValueError:
                pass
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
    return value


def _take(config: CanonicalConfig, data: dict, kind: str):
    index = _KIND_INDEX[kind]
    used = set()
    for key, names in ALIASES.items():
        for name in names[index]:
            if name in data and data[name] is not None:
                config.values[key], config.names[key] = _number(data[name]), name
                used.add(name)
                break
    return used


def _default(config: CanonicalConfig, key: str, value, source: str | None = None):
    if key not in config.values and value is not None:
        config.values[key] = value
        config.defaulted.add(key)
        if source is not None:
            config.derived[key] = source


def _from_megatron(path: Path, args: dict) -> CanonicalConfig:
    config = CanonicalConfig(str(path), "megatron")
    used = _take(config, args, "megatron")
    flag = lambda name: bool(_number(args.get(name, False)))  # noqa: E731
    config.values["add_bias_linear"] = not flag("disable-bias-linear")
    config.names["add_bias_linear"] = "disable-bias-linear" + ("" if "disable-bias-linear" in args else
                                                               " (absent: biases on)")
    activation = ("swiglu" if flag("swiglu") else "squared_relu" if flag("squared-relu") else "gelu")
    config.values["activation"], config.names["activation"] = activation, (
        "swiglu" if flag("swiglu") else "squared-relu" if flag("squared-relu") else "(default: gelu)")
    config.values["tie_embeddings"] = not flag("untie-embeddings-and-output-weights")
    config.names["tie_embeddings"] = "untie-embeddings-and-output-weights"
    if not flag("group-query-attention"):
        config.values.pop("num_query_groups", None)
    heads = config.values.get("num_attention_heads")
    _default(config, "num_query_groups", heads, "num_attention_heads")
    if "add_qkv_bias" in config.values or flag("add-qkv-bias"):
        config.values["add_qkv_bias"] = True
    else:
        _default(config, "add_qkv_bias", config.values["add_bias_linear"], "add_bias_linear")
    if flag("use-rotary-position-embeddings"):
        _default(config, "position_embedding_type", "rope")
    _default(config, "position_embedding_type", "learned_absolute")
    if config.values["position_embedding_type"] == "rope":
        _default(config, "rotary_base", 10000)
        _default(config, "rotary_percent", 1.0)
    for key, value in (("normalization", "LayerNorm"), ("norm_epsilon", 1e-5), ("attention_dropout", 0.1),
                       ("hidden_dropout", 0.1)):
        _default(config, key, value)
    if "hidden_size" in config.values:
        _default(config, "ffn_hidden_size", 4 * int(config.values["hidden_size"]))
    if heads and "hidden_size" in config.values:
        _default(config, "head_dim", int(config.values["hidden_size"]) // int(heads), "hidden_size")
    config.unmapped = sorted(k for k in args if k not in used and k not in _MEGATRON_FLAGS)
    return config


def _model_config(data: dict) -> dict:
    """The ``model_config`` mapping of a MindSpore Transformers YAML (``model: model_config: ...``), else the
    whole file."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("model_config"), dict):
                return node["model_config"]
            stack.extend(v for v in node.values() if isinstance(v, dict))
    return data


def _from_mindformers(path: Path, data: dict) -> CanonicalConfig:
    config = CanonicalConfig(str(path), "mindformers")
    model = _model_config(data)
    used = _take(config, model, "mindformers")
    act = str(model.get("hidden_act", "")).lower()
    gated = bool(_number(model.get("gated_linear_unit", True)))  # the legacy Llama family is gated
    if act:
        config.values["activation"] = {"silu": "swiglu", "swish": "swiglu"}.get(act, act) if gated else act
        config.names["activation"] = "hidden_act" + (" + gated_linear_unit" if "gated_linear_unit" in model else "")
        used |= {"hidden_act", "gated_linear_unit"}
    if "untie_embeddings_and_output_weights" in model or "tie_word_embeddings" in model:
        name = "untie_embeddings_and_output_weights" if "untie_embeddings_and_output_weights" in model else \
            "tie_word_embeddings"
        value = bool(_number(model[name]))
        config.values["tie_embeddings"], config.names["tie_embeddings"] = (not value if name.startswith("untie")
                                                                           else value), name
        used.add(name)
    if "add_bias_linear" in config.values and "add_qkv_bias" not in config.values:
        _default(config, "add_qkv_bias", config.values["add_bias_linear"], "add_bias_linear")
    _default(config, "num_query_groups", config.values.get("num_attention_heads"), "num_attention_heads")
    if "rotary_base" in config.values:
        _default(config, "position_embedding_type", "rope")
    config.unmapped = sorted(k for k in model if k not in used)
    return config


def _from_hf(path: Path, data: dict) -> CanonicalConfig:
    config = CanonicalConfig(str(path), "hf")
    used = _take(config, data, "hf")
    model_type = str(data.get("model_type", "")).lower()
    act = next((data[k] for k in ("hidden_act", "hidden_activation", "activation_function") if k in data), None)
    if act is not None:
        act = str(act).lower()
        if model_type in _GATED_HF:
            act = {"silu": "swiglu", "swish": "swiglu"}.get(act, "geglu" if act.startswith("gelu") else act)
        elif act.startswith("gelu"):
            act = "gelu"
        config.values["activation"], config.names["activation"] = act, "hidden_act"
    if "attention_bias" in data or model_type in _HF_QKV_BIAS:
        config.values["add_qkv_bias"] = bool(data.get("attention_bias")) or model_type in _HF_QKV_BIAS
        config.names["add_qkv_bias"] = "attention_bias"
    if "mlp_bias" in data or "attention_bias" in data:
        config.values["add_bias_linear"] = bool(data.get("mlp_bias")) and bool(data.get("attention_bias"))
        config.names["add_bias_linear"] = "attention_bias + mlp_bias"
    if "rms_norm_eps" in data:
        _default(config, "normalization", "RMSNorm")
    elif "layer_norm_eps" in data or "layer_norm_epsilon" in data:
        _default(config, "normalization", "LayerNorm")
    if "rope_theta" in data or model_type in _GATED_HF:
        _default(config, "position_embedding_type", "rope")
    _default(config, "tie_embeddings", True)  # PretrainedConfig's default
    _default(config, "num_query_groups", config.values.get("num_attention_heads"), "num_attention_heads")
    heads, hidden = config.values.get("num_attention_heads"), config.values.get("hidden_size")
    if heads and hidden and "head_dim" not in config.values:
        _default(config, "head_dim", int(hidden) // int(heads), "hidden_size")
    config.unmapped = sorted(k for k in data if k not in used and k not in (
        "hidden_act", "hidden_activation", "activation_function", "attention_bias", "mlp_bias"))
    return config


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b) if isinstance(a, (bool, int)) and isinstance(b, (bool, int)) else a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return str(a).lower().replace("_", "") == str(b).lower().replace("_", "")


def diff_configs(a: CanonicalConfig, b: CanonicalConfig) -> dict:
    """What differs between two canonical configs, and what only one of them sets."""
    differ, only_a, only_b = [], [], []
    for key in ALIASES:
        in_a, in_b = key in a.values, key in b.values
        if in_a and in_b:
            source = a.derived.get(key) or b.derived.get(key)
            if source is not None and source in a.values and source in b.values \
                    and not _same(a.values[source], b.values[source]):
                continue  # follows a difference already reported
            if not _same(a.values[key], b.values[key]):
                differ.append({"key": key, "a": a.values[key], "b": b.values[key],
                               "name_a": a.names.get(key, "(default)"), "name_b": b.names.get(key, "(default)"),
                               "default_a": key in a.defaulted, "default_b": key in b.defaulted})
        elif in_a:
            only_a.append(key)
        elif in_b:
            only_b.append(key)
    return {"verdict": "differ" if differ else "same", "a": {"path": a.path, "kind": a.kind},
            "b": {"path": b.path, "kind": b.kind}, "differ": differ, "only_a": only_a, "only_b": only_b,
            "unmapped": {"a": a.unmapped, "b": b.unmapped},
            "compared": sum(1 for key in ALIASES if key in a.values and key in b.values)}
