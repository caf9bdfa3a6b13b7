"""The Megatron-Core `torch_dist` checkpoints of the architectures whose Megatron modules exist
only as TransformerEngine or CUDA-kernel code (gated DeltaNet, Mamba-2), each written once by
`megatron_bridge_registry_save.py` (run with the Python of
`megatron_bridge_env.megatron_bridge_python`) into a folder of its own: Megatron's real modules
built on CPU with stand-ins for TE's layers, loaded by Megatron-Bridge 0.6.2's own mapping
registry, saved by Megatron-Core 0.19.2's own `dist_checkpointing.save`, laid out as verl's
Megatron backend saves (`model/dist_ckpt/`, `model/huggingface/`), with Megatron-Bridge's export
and the original Hugging Face model's logits beside it (`reference/`). The writer's docstring
says what is Megatron's own code and what is stood in."""

from __future__ import annotations

import os

from support.megatron_bridge_env import megatron_bridge_python
from support.virtualenvs import MEGATRON_CACHE, write_cases

SAVE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_bridge_registry_save.py")

# name: megatron_bridge_registry_save.py's arguments. Each model mixes its two layer kinds
# (3 gated-DeltaNet layers then a gated full-attention one; Mamba, MoE, attention and MLP layers;
# Falcon-H1's parallel attention + Mamba layers), which Megatron saves per layer, not stacked.
REGISTRY_CASES = {
    # MoE with a gated shared expert, and a multi-token-prediction layer (`mtp.layers.0.*`)
    "qwen3_next-tp2-mtp": ["--arch", "Qwen3NextForCausalLM", "--tp", "2", "--mtp", "1"],
    # dense MLP; separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; an MTP layer
    "qwen3_5-tp2-mtp": ["--arch", "Qwen3_5ForCausalLM", "--tp", "2", "--mtp", "1"],
    # routed experts (saved per expert by transformers) and a gated shared expert, in bfloat16
    "qwen3_5_moe-tp2-bf16": ["--arch", "Qwen3_5MoeForCausalLM", "--tp", "2", "--dtype", "bfloat16"],
    # `language_model.` (per layer, MTP under `language_model.mtp.`) and `vision_model.` (stacked) towers
    "qwen3_5_vl-tp2-mtp": ["--arch", "Qwen3_5ForConditionalGeneration", "--tp", "2", "--mtp", "1"],
    # (no --mtp: Megatron-Bridge 0.6.2 maps Qwen3.5-MoE's MTP experts only in TE's grouped layout)
    "qwen3_5_moe_vl-tp2": ["--arch", "Qwen3_5MoeForConditionalGeneration", "--tp", "2"],
    # Mamba-2 mixer, MoE (sigmoid router with expert bias), attention and squared-ReLU MLP layers
    "nemotron_h-tp2": ["--arch", "NemotronHForCausalLM", "--tp", "2"],
    # TP 1: Megatron-Bridge 0.6.2's Falcon-H1 layer cannot save at TP > 1 (the writer says why)
    "falcon_h1-tp1": ["--arch", "FalconH1ForCausalLM", "--tp", "1"],
}


def write_registry_checkpoints(root: str) -> dict[str, str]:
    """Every case of `REGISTRY_CASES` saved under `root`, by name, by one Megatron-Bridge process;
    the folder each was saved in (its `model/` the source to export, `reference/` what the export
    must reproduce)."""
    python = megatron_bridge_python(MEGATRON_CACHE)
    return write_cases(python, SAVE_SCRIPT, root, REGISTRY_CASES, timeout=1200)
