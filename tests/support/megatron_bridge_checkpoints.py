"""The Megatron-Bridge checkpoints the session's tests share: each a real Megatron-Core `torch_dist`
checkpoint written by Megatron-Bridge 0.6.2 itself (on Megatron-Core 0.19.2), on CPU gloo ranks, by
`megatron_bridge_save.py` (run with the Python of `megatron_bridge_env.megatron_bridge_python`),
into a folder of its own, with Megatron-Bridge's own Hugging Face export and the original Hugging
Face model's logits beside it (`reference/`)."""

from __future__ import annotations

import os
import subprocess

from support.megatron_bridge_env import megatron_bridge_python
from support.virtualenvs import MEGATRON_CACHE, REPO, write_cases

SAVE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_bridge_save.py")

# name: megatron_bridge_save.py's arguments; each a different way Megatron-Bridge builds, splits,
# names or stores a model
CASES = {
    "qwen3-tp2": ["--arch", "Qwen3ForCausalLM", "--tp", "2"],
    "qwen3_vl-tp2": ["--arch", "Qwen3VLForConditionalGeneration", "--tp", "2"],
    "qwen3_vl_moe-ep2": ["--arch", "Qwen3VLMoeForConditionalGeneration", "--ep", "2"],
    "gpt_oss-ep2": ["--arch", "GptOssForCausalLM", "--ep", "2"],
    "glm4_moe-ep2-megatron-lm": ["--arch", "Glm4MoeForCausalLM", "--ep", "2", "--layout", "megatron-lm"],
    "glm4v_moe-ep2": ["--arch", "Glm4vMoeForConditionalGeneration", "--ep", "2"],
    "glm4_moe_lite-ep2": ["--arch", "Glm4MoeLiteForCausalLM", "--ep", "2"],
    "deepseek_v2-ep2-megatron-lm": ["--arch", "DeepseekV2ForCausalLM", "--ep", "2", "--layout", "megatron-lm"],
    "deepseek_v3-ep2-mtp1": ["--arch", "DeepseekV3ForCausalLM", "--ep", "2", "--mtp", "1"],
    "glm4_moe-ep2-mtp1": ["--arch", "Glm4MoeForCausalLM", "--ep", "2", "--mtp", "1"],
    "gemma-tp2": ["--arch", "GemmaForCausalLM", "--tp", "2"],
    "gemma4-tp2-megatron-lm": ["--arch", "Gemma4ForCausalLM", "--tp", "2", "--layout", "megatron-lm"],
    "olmoe-ep2": ["--arch", "OlmoeForCausalLM", "--ep", "2"],
    "minimax_m2-ep2": ["--arch", "MiniMaxM2ForCausalLM", "--ep", "2"],
    "nemotron-tp2": ["--arch", "NemotronForCausalLM", "--tp", "2"],
    "exaone_moe-ep2": ["--arch", "ExaoneMoeForCausalLM", "--ep", "2"],
    "ernie4_5_moe-ep2-megatron-lm": ["--arch", "Ernie4_5_MoeForCausalLM", "--ep", "2", "--layout", "megatron-lm"],
    "hy_v3-ep2": ["--arch", "HYV3ForCausalLM", "--ep", "2"],
    "qwen2_5_vl-tp2-megatron-lm": ["--arch", "Qwen2_5_VLForConditionalGeneration", "--tp", "2",
                                   "--layout", "megatron-lm"],
    "mistral3-tp2": ["--arch", "Mistral3ForConditionalGeneration", "--tp", "2"],
    "llama-pp2-uneven-megatron-lm": ["--arch", "LlamaForCausalLM", "--pp", "2", "--first-stage-layers", "1",
                                     "--last-stage-layers", "3", "--layout", "megatron-lm"],
    "mistral-tp2-pp2-vpp2": ["--arch", "MistralForCausalLM", "--tp", "2", "--pp", "2", "--vpp", "2"],
    "qwen2-tp2-pp2-bf16-pad-vocab": ["--arch", "Qwen2ForCausalLM", "--tp", "2", "--pp", "2", "--dtype", "bfloat16",
                                     "--pad-vocab"],
    "qwen3_moe-ep2-etp2": ["--arch", "Qwen3MoeForCausalLM", "--ep", "2", "--etp", "2"],
    "gpt_oss-tp2-ep2-bf16": ["--arch", "GptOssForCausalLM", "--tp", "2", "--ep", "2", "--dtype", "bfloat16"],
    "qwen3-critic-tp2": ["--arch", "Qwen3ForCausalLM", "--tp", "2", "--untied", "--value-head"],
}


# The key, among the saves, of tools/megatron_bridge_tables.py's output for this Megatron-Bridge.
GENERATED_TABLES = "generated-tables"
TABLES_SCRIPT = os.path.join(REPO, "tools", "megatron_bridge_tables.py")


def write_megatron_bridge_checkpoints(root: str) -> dict[str, str]:
    """Every case of `CASES` saved under `root`, by name, by one Megatron-Bridge process; the
    folder each was saved in; and under `GENERATED_TABLES`, the tables the script makes of this
    Megatron-Bridge's registries (written here, beside the saves, so that no test waits for its
    import)."""
    python = megatron_bridge_python(MEGATRON_CACHE)
    tables = os.path.join(root, "megatron_bridge_tables.json")
    os.makedirs(root, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    subprocess.run([python, TABLES_SCRIPT, "--out", tables], check=True, timeout=300, capture_output=True, env=env)
    return {**write_cases(python, SAVE_SCRIPT, root, CASES, timeout=900), GENERATED_TABLES: tables}


def source_of(folder: str) -> tuple[str, list[str]]:
    """`--src` for a saved case, as its trainer's users point at it, and the options it needs."""
    if os.path.exists(os.path.join(folder, "latest_checkpointed_iteration.txt")):
        # Megatron-Bridge's `save_megatron_model` keeps no Hugging Face config beside its iterations
        return folder, ["--hf-config", os.path.join(folder, "hf")]
    return os.path.join(folder, "model"), []
