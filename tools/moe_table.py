#!/usr/bin/env python3
"""docs/moe.md's table of every mixture-of-experts causal LM the installed transformers ships, and
what a prune does to each.

Every causal-LM model type whose config names experts (``num_experts``, ``n_routed_experts``, …) is
built as a tiny random model, pruned with ``prune_model(model, ids, ArmorConfig(...))`` (block size
8, one BCD sweep, nothing else), and checked with code of its own (not the project's layer lists):
every weight of 2 or more dimensions under an ``experts`` module must be an ARMOR weight afterwards,
and the model written by ``save_pretrained`` must load back (``load_pretrained``) with bit-identical
logits. The status of a model type:

* ``pruned``: every expert weight is ARMOR;
* ``experts dense (<why>)``: some expert weights stay dense and the report says why;
* ``silently dense``: some stay dense and the report gives no reason (never acceptable);
* ``refused (<message>)``: ``prune_model`` raised torch_armor's one-line error;
* ``fails (<error>)``: any other exception (a bug), or ``fails (save/load: <what>)``;
* ``untested (<why>)``: no tiny model of it could be built.

The table stands in docs/moe.md between ``<!-- generated: moe architectures (tools/moe_table.py) -->``
and ``<!-- end generated: moe architectures -->``; ``tests/tools/test_moe_table.py`` fails when a
model type is missing from it (a new transformers) or a status changed. Rewrite it with:

    python tools/moe_table.py --write            # about a minute or two on one thread
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "moe.md"
NAME = "moe architectures"
BEGIN, END = f"<!-- generated: {NAME} (tools/moe_table.py) -->", f"<!-- end generated: {NAME} -->"

#: config fields that hold a number of experts
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: sizes every tiny config gets where the config has the field
TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=8, vocab_size=64, max_position_embeddings=64,
            num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
            num_experts_per_tok=2, moe_topk=2, moe_k=2, top_k_experts=2, num_experts_per_token=2,
            shared_expert_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_shared_experts=1,
            num_shared_experts=1, moe_num_shared_experts=1, first_k_dense_replace=0, decoder_sparse_step=1,
            enable_moe_block=True, expert_ffn_hidden_size=16, n_group=1, topk_group=1, num_expert_group=1,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            router_hidden_size=16, sliding_window=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
            is_moe=True, num_dense_layers=0, mlp_only_layers=[], mlp_layer_types=["sparse", "sparse"])
#: per model type: fields the generic sizes get wrong
OVERRIDES: Dict[str, Dict[str, Any]] = {
    "zaya": dict(num_experts_per_tok=1),  # ZAYA supports top-1 only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # no default
    "mimo_v2_flash": dict(mlp_layer_types=["dense", "sparse"], num_key_value_heads=2),  # as its defaults: GQA, layer 0 dense
    "longcat_flash": dict(num_layers=2, zero_expert_num=2, ffn_hidden_size=64, qk_head_dim=16),
    "jamba": dict(mamba_dt_rank=8, mamba_d_state=16),  # dt_proj (64, 8), x_proj (40, 64): shapes block size 8 fits
    "deepseek_v4": dict(layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe"]),  # its defaults list 43 layers: the config must match
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2),
}


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001  (several text configs: the top-level one holds the sizes)
        return config


def moe_model_types() -> List[str]:
    """The installed transformers' causal-LM model types whose config has a number of experts."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001  (a config that needs arguments: judged by its class's fields below)
            config = None
        fields = set(_text_config(config).to_dict()) if config is not None else set(
            getattr(CONFIG_MAPPING[model_type], "__dataclass_fields__", {}))
        if fields & set(EXPERT_COUNTS) or "enable_moe_block" in fields or "ffn_config" in fields:
            out.append(model_type)
    return out


def tiny_model(model_type: str) -> Any:
    """A random tiny ``model_type`` causal LM (hidden 32, 4 experts, top-2, 2 layers)."""
    import torch
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    default = CONFIG_MAPPING[model_type]()
    text = _text_config(default)
    fields = text.to_dict()
    sizes = {k: v for k, v in dict(TINY, **OVERRIDES.get(model_type, {})).items() if k in fields}
    if fields.get("pad_token_id") is not None:
        sizes["pad_token_id"] = 0
    try:  # built from the sizes, so that derived fields (layer types, dense/sparse layers) follow them
        built = type(text)(**sizes)
        config = built if text is default else type(default)(text_config=built.to_dict())
    except Exception:  # noqa: BLE001  (a config whose validation wants more: set the fields on the default)
        config = default
        for key, value in sizes.items():
            setattr(text, key, value)
    if model_type == "dbrx":
        config = CONFIG_MAPPING["dbrx"](d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=64,
                                        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 110 else text[:107] + "..."


def expert_weights(model: Any) -> List[str]:
    """Names of the weights of 2 or more dimensions inside an ``experts`` module (biases excepted), of
    3-D weights anywhere but in convolutions (JetMoE's MLP experts are ``mlp.input_linear.weight``), and
    of embeddings inside the decoder layers (Doge's experts are rows looked up by index). The 3-D rule
    holds inside the decoder layers only (Inkling-2-Loop's ``model.message_input.query`` is no expert)."""
    from torch import nn

    inner = {f"{name}.weight" for name, m in model.named_modules()
             if isinstance(m, nn.Embedding) and re.search(r"\.\d+\.", name)}
    inner |= {f"{name}.{pname}" for name, m in model.named_modules()
              if not isinstance(m, nn.modules.conv._ConvNd) and re.search(r"\.\d+\.|\.\d+$", name)
              for pname, p in m.named_parameters(recurse=False) if p.dim() == 3}
    return [n for n, p in model.named_parameters()
            if p.dim() >= 2 and "bias" not in n and (n in inner or re.search(r"(^|\.)experts\.", n))]


def status(model_type: str) -> str:
    """What a tiny prune of ``model_type`` does (see the module docstring)."""
    import torch

    from torch_armor.config.armor import ArmorConfig, BcdConfig
    from torch_armor.engine.prune import PruneOptions, prune_model
    from torch_armor.errors import ArmorError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(model_type)
    except Exception as err:  # noqa: BLE001  (reported in the table)
        return f"untested (tiny config: {type(err).__name__}: {_one_line(err)})"
    reload = config_reload_error(model.config)
    if reload:
        return f"untested (the tiny config does not reload in transformers: {reload})"
    experts = expert_weights(model)
    if not experts:
        return "untested (the tiny model has no experts module)"
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(0))
    config = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1), refine=None, reconstruct=None, distill=None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = prune_model(model, ids, config, options=PruneOptions(progress=False))
    except ArmorError as err:
        return f"refused ({_one_line(err)})"
    except Exception as err:  # noqa: BLE001  (a bug: reported in the table)
        return f"fails ({type(err).__name__}: {_one_line(err)})"
    trip = round_trip(model, ids)
    if trip:
        return f"fails (save/load: {trip})"
    dense = [n for n in experts if not hasattr(type(model.get_parameter(n)), "__tensor_flatten__")]
    why = {}
    for n in dense:
        matches = [reason for pattern, (_, reason) in report.dense_weights.items()
                   if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), n)]
        why[n] = matches[0] if matches else "not selected"
    reasons = {reason for reason in why.values() if not reason.startswith("router")}  # a router inside experts
    if not reasons:
        return "pruned"
    if "not selected" in reasons:
        return "silently dense"
    return f"experts dense ({'; '.join(sorted(reasons))})"


def config_reload_error(config: Any) -> str:
    """``""`` when ``config`` saved by transformers loads back, else why not (one line): a tiny config
    set field by field can break a rule its class checks on load, and then no save/load can be tested."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config.save_pretrained(d)
            AutoConfig.from_pretrained(d)
        except Exception as err:  # noqa: BLE001  (reported in the table)
            return f"{type(err).__name__}: {_one_line(err)}"
    return ""


def round_trip(model: Any, ids: Any) -> str:
    """``""`` when ``model`` saved with ``save_pretrained`` loads back with bit-identical logits on
    ``ids``, else what went wrong (one line)."""
    import tempfile

    import torch

    from torch_armor.format.serialization import load_pretrained, save_pretrained

    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            want = model(ids, use_cache=False).logits
            save_pretrained(model, d)
            got = load_pretrained(d)(ids, use_cache=False).logits
        except Exception as err:  # noqa: BLE001  (reported in the table)
            return f"{type(err).__name__}: {_one_line(err)}"
    return "" if torch.equal(want, got) else f"logits differ by up to {(want - got).abs().max().item():.3g}"


def table(statuses: Dict[str, str]) -> str:
    lines = ["| model type | status |", "|---|---|"]
    lines += [f"| `{t}` | {s.replace('|', '/')} |" for t, s in sorted(statuses.items())]
    return "\n".join(lines)


def stated(text: str) -> Optional[Dict[str, str]]:
    """The table docs/moe.md holds, as ``{model type: status}`` (``None`` without the markers)."""
    if BEGIN not in text or END not in text:
        return None
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", body, flags=re.M)
    return dict(rows)


def write(statuses: Dict[str, str]) -> None:
    text = PAGE.read_text(encoding="utf-8")
    block = f"{BEGIN}\n{table(statuses)}\n{END}"
    if BEGIN in text:
        text = text.split(BEGIN, 1)[0] + block + text.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    PAGE.write_text(text, encoding="utf-8")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/moe.md")
    parser.add_argument("model_types", nargs="*", help="only these (default: every MoE model type)")
    args = parser.parse_args(argv)
    statuses = {}
    for model_type in args.model_types or moe_model_types():
        statuses[model_type] = status(model_type)
        print(f"{model_type}: {statuses[model_type]}", flush=True)
    if args.write:
        write(statuses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
