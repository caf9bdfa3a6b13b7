"""mbridge's own conversion of a model's Hugging Face tensors to Megatron-Core's and back, for the
models whose Megatron-Core checkpoints cannot be written on CPU here (Qwen2.5-VL: see
docs/layouts.md).

Run with a Python that `megatron_env.megatron_python` made (mbridge 0.15.1), not the project's:

    python mbridge_conversion.py --config CONFIG.json --hf HF.safetensors --out DIR

For every Megatron-Core parameter name that mbridge's bridge for the config's model type maps
(its own mapping tables: each entry, at every layer of the language model and of the vision
tower; those of parameters the model lacks, as biases, left out), it takes the Hugging Face tensors that name maps to (`_weight_name_mapping_mcore_to_hf`)
from HF.safetensors, makes the Megatron-Core tensor of them with the bridge's
`_weight_to_mcore_format` (the import verl runs to load Hugging Face weights into Megatron), and
converts that back with `_weight_to_hf_format` (its export). It writes `DIR/megatron.safetensors`,
each Megatron-Core tensor by its per-layer parameter name, and `DIR/mbridge.safetensors`, the
export: what rayexport must make of a checkpoint holding those Megatron-Core tensors.

The bridge is built with `parallel_states` of one rank (no process group: only its conversions
run, which build no model), and is given the config fields mbridge 0.15.1 reads as attributes
where transformers 5 keeps them elsewhere (`rope_theta`, `rope_scaling`; the language model's
sizes, which it reads at the top of a VLM's config)."""

from __future__ import annotations

import argparse
import json
import os

import torch


def bridge_of(config_file: str):
    """mbridge's bridge for the model of `config_file`, of one rank, with the config fields it reads."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from mbridge.core.parallel_states import ParallelStates
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.dirname(config_file))
    text = getattr(config, "text_config", config)
    for field in ("num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size", "num_hidden_layers",
                  "intermediate_size", "max_position_embeddings", "rms_norm_eps", "attention_dropout"):
        setattr(config, field, getattr(text, field))
    parameters = getattr(text, "rope_parameters", None) or {}
    config.rope_theta = parameters.get("rope_theta", getattr(text, "rope_theta", None))
    config.rope_scaling = dict(parameters, mrope_section=parameters.get("mrope_section"))
    return _MODEL_REGISTRY[config.model_type](config, dtype=torch.float32, parallel_states=ParallelStates())


def megatron_names(bridge) -> list[str]:
    """Every parameter name mbridge's mapping tables give, at each layer of its tower."""
    config = bridge.hf_config
    depth = {"language_model.": config.num_hidden_layers}
    if hasattr(config, "vision_config"):
        depth["vision_model."] = config.vision_config.depth
    names = list(bridge._DIRECT_MAPPING)
    for table in (bridge._ATTENTION_MAPPING, bridge._MLP_MAPPING, getattr(bridge, "_OTHER_MAPPING", {})):
        for pattern in table:
            tower = next(prefix for prefix in depth if pattern.startswith(prefix))
            names.extend(pattern.format(layer_number=layer) for layer in range(depth[tower]))
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file

    bridge = bridge_of(args.config)
    hf = load_file(args.hf)
    megatron, exported = {}, {}
    for name in megatron_names(bridge):
        hf_names = bridge._weight_name_mapping_mcore_to_hf(name)
        held = [hf_name in hf for hf_name in hf_names]
        if not any(held) or name == "language_model.output_layer.weight" and bridge._get_hf_shared_weight_keys():
            continue  # a parameter the model does not have (a bias), or a tied head Megatron-Core does not hold
        if not all(held):
            missing = next(hf_name for hf_name, present in zip(hf_names, held) if not present)
            raise SystemExit(f"mbridge maps '{name}' to '{missing}', which the Hugging Face model does not have")
        megatron[name] = bridge._weight_to_mcore_format(name, [hf[hf_name] for hf_name in hf_names]).contiguous()
        for hf_name, tensor in zip(*bridge._weight_to_hf_format(name, megatron[name])):
            exported[hf_name] = tensor.contiguous()
    os.makedirs(args.out, exist_ok=True)
    save_file(megatron, os.path.join(args.out, "megatron.safetensors"))
    save_file(exported, os.path.join(args.out, "mbridge.safetensors"))
    with open(os.path.join(args.out, "names.json"), "w") as f:
        json.dump({name: bridge._weight_name_mapping_mcore_to_hf(name) for name in megatron}, f, indent=1)


if __name__ == "__main__":
    main()
