"""Tiny models for the tests, built from configs (no download): the demo's tied and untied
models, a remote-code model, LoRA settings, Llama configs sized to a byte count, and models
whose in-memory names differ from their on-disk format (MoE, vision-language)."""

from __future__ import annotations

import json
import os
import tempfile

import torch

from rayexport.common.dtypes import dtype_of
from rayexport.demo import build_model, tiny_config, write_hf_folder  # noqa: F401 - the tests' source of them

# The prompt every reference logit is computed on.
PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}

# A tiny trust_remote_code model: its own config and model classes, the modeling file importing
# the configuration file relatively, as models on the Hub do.
REMOTE_CODE = {
    "configuration_tiny.py": (
        "from transformers import Qwen2Config\n\n\n"
        "class TinyConfig(Qwen2Config):\n"
        "    model_type = 'tiny-remote'\n"
    ),
    "modeling_tiny.py": (
        "from transformers import Qwen2ForCausalLM\n\n"
        "from .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(Qwen2ForCausalLM):\n"
        "    config_class = TinyConfig\n"
    ),
}
REMOTE_AUTO_MAP = {
    "AutoConfig": "configuration_tiny.TinyConfig",
    "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
    "AutoModelForSequenceClassification": None,
}

TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=128, dtype="float32")
VISION_ROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}


def reference_logits(model: torch.nn.Module) -> torch.Tensor:
    """The model's logits on `PROMPT_IDS`: what an export of it must reproduce."""
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT_IDS)).logits


def remote_code_config(folder: str):
    """The remote-code model's config, loaded through transformers from a folder of its code."""
    from transformers import AutoConfig

    os.makedirs(folder, exist_ok=True)
    for name, source in REMOTE_CODE.items():
        with open(os.path.join(folder, name), "w") as handle:
            handle.write(source)
    config = tiny_config("qwen2-tied").to_dict()
    config.update(model_type="tiny-remote", architectures=["TinyForCausalLM"], auto_map=REMOTE_AUTO_MAP)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(config, handle)
    return AutoConfig.from_pretrained(folder, trust_remote_code=True)


def with_random_lora(model: torch.nn.Module, lora: dict, seed: int) -> torch.nn.Module:
    """Wrap in a PeftModel (`lora`: peft `LoraConfig` arguments) whose A and B are random: peft
    initialises B to zero, which would make any merge look right."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return peft_model.eval()


def sized_llama_config(target_bytes: int, hidden_size: int = 1024, vocab_size: int = 32000, dtype: str = "bfloat16"):
    """An untied Llama config whose weights take about `target_bytes` in `dtype` (for
    benchmarks and memory tests: the number of layers is chosen to fit)."""
    from transformers import LlamaConfig

    intermediate = hidden_size * 11 // 4
    per_layer = 4 * hidden_size * hidden_size + 3 * hidden_size * intermediate + 2 * hidden_size
    fixed = 2 * vocab_size * hidden_size + hidden_size
    layers = max(1, round((target_bytes / dtype_of(dtype).itemsize - fixed) / per_layer))
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
        tie_word_embeddings=False, dtype=dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def tiny_format_config(architecture: str):
    """A tiny (hidden 64, 2 layers) config of `architecture`, a model whose in-memory names
    (what transformers 5 holds) differ from its on-disk format (what `save_pretrained` writes)."""
    import transformers

    if architecture == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**TEXT, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, head_dim=16, tie_word_embeddings=False)
        config.architectures = ["Qwen3MoeForCausalLM"]
    elif architecture == "mixtral":
        config = transformers.MixtralConfig(**TEXT, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                            tie_word_embeddings=False)
        config.architectures = ["MixtralForCausalLM"]
    elif architecture == "deepseek_v3":  # one dense layer, then one MoE layer
        config = transformers.DeepseekV3Config(
            **dict(TEXT, num_key_value_heads=4), intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=False,
        )
        config.architectures = ["DeepseekV3ForCausalLM"]
    elif architecture == "qwen2_vl":
        config = transformers.Qwen2VLConfig(
            text_config=dict(TEXT, intermediate_size=128, rope_scaling=VISION_ROPE, tie_word_embeddings=False),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2),
        )
        config.architectures = ["Qwen2VLForConditionalGeneration"]
    elif architecture == "qwen2_5_vl":  # tied, declared only in text_config
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(TEXT, intermediate_size=128, rope_scaling=VISION_ROPE, tie_word_embeddings=True),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, fullatt_block_indexes=[1]),
        )
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    elif architecture == "qwen3":
        config = transformers.Qwen3Config(**TEXT, intermediate_size=128, head_dim=16, tie_word_embeddings=True)
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        raise ValueError(f"unknown architecture {architecture!r}")
    return config


# vLLM's CPU attention runs head_dim 32 and up (not 8 or 16): the serving check's models.
SERVING = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
               vocab_size=256, max_position_embeddings=128, dtype="float32", initializer_range=0.3)


def serving_config(kind: str):
    """A tiny config for the vLLM check: `qwen2-tied`, `llama-untied`, `qwen3_moe` (untied, 4
    experts) with head_dim 32, or `qwen2-head16`, whose head_dim vLLM's CPU attention refuses.
    Its larger initializer range gives decisive logits, so a wrong weight moves the top token."""
    import transformers

    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**SERVING, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, tie_word_embeddings=False)
        config.architectures = ["Qwen3MoeForCausalLM"]
        return config
    if kind == "qwen2-head16":
        return tiny_config("qwen2-tied", **dict(SERVING, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    if kind in FAMILIES:
        config_class, settings = FAMILIES[kind]
        config = getattr(transformers, config_class)(**dict(SERVING, **settings))
        config.architectures = [config_class.replace("Config", "ForCausalLM")]
        return config
    return tiny_config(kind, **SERVING, intermediate_size=128)


# More families for benchmarks/vllm_families.py (DeepSeek-V3: vLLM reads `topk_method` and
# `scoring_func`, which transformers' config does not write).
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                      tie_word_embeddings=False)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=32, tie_word_embeddings=False, topk_method="noaux_tc", scoring_func="sigmoid",
    )),
}


def model_of(config) -> torch.nn.Module:
    """The model of `config` with freshly initialised weights: the transformers class its
    `architectures` names, else (remote code) the Auto class its `auto_map` maps to."""
    import transformers

    cls = getattr(transformers, config.architectures[0], None)
    if cls is None:
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    return cls._from_config(config)


def build_format_model(config, seed: int = 0) -> torch.nn.Module:
    """The model of `config` with deterministic random weights, norms moved off 1.0 and
    routers made decisive, so a swapped expert or tensor changes the logits."""
    torch.manual_seed(seed)
    model = model_of(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith("gate.weight") or "experts" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.5)
    return model.eval()


def saved_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and config.json `save_pretrained` writes for `model`: its on-disk format."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        state = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(folder, name)))
        with open(os.path.join(folder, "config.json")) as handle:
            return state, json.load(handle)
