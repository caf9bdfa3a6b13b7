"""The Megatron-Core checkpoints the session's tests share: each written once, by Megatron-Core's
own code (`megatron_save.py`, run with the Python of `megatron_env.megatron_python`), into a
folder of its own, with mbridge's export and Megatron's logits beside it (`reference/`); and
`VLM_CASE`, a Qwen2.5-VL made from mbridge's conversion tables (`megatron_vlm.py` says why)."""

from __future__ import annotations

import os

from support.megatron_env import megatron_python
from support.megatron_vlm import write_qwen2_5_vl
from support.virtualenvs import MEGATRON_CACHE, write_cases

SAVE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_save.py")

# name: megatron_save.py's arguments; each a different way Megatron splits, names or stores the
# model that the Megatron-Bridge saves (support/megatron_bridge_checkpoints.py) do not: trained
# weights, the distributed optimizer's state, TransformerEngine's keys, mbridge's own models
CASES = {
    "llama-tp2-untied-megatron-lm": ["--model", "llama", "--tp", "2", "--untied", "--layout", "megatron-lm"],
    "qwen3_moe-ep2-grouped-bf16-optimizer": [
        "--model", "qwen3_moe", "--ep", "2", "--untied", "--experts", "grouped", "--dtype", "bfloat16", "--optimizer",
        "--layout", "megatron-lm",
    ],
    # saved under TransformerEngine's keys, as GPU runs save (megatron_save.py's `te_spec_keys`)
    "mixtral-ep2-te-names": ["--model", "mixtral", "--ep", "2", "--untied", "--names", "te"],
    # multi-latent attention, a dense layer then MoE ones (each layer saved apart), shared experts
    "deepseek_v3-ep2-te-names": ["--model", "deepseek_v3", "--ep", "2", "--untied", "--names", "te"],
    # a shared expert behind a sigmoid gate, q/k/v biases
    "qwen2_moe-ep2-shared-expert-gate": ["--model", "qwen2_moe", "--ep", "2", "--untied"],
}


VLM_CASE = "qwen2_5_vl-mbridge-conversion"


def write_megatron_checkpoints(root: str) -> dict[str, str]:
    """Every case of `CASES` saved under `root`, by name, by one Megatron process, and
    `VLM_CASE`; the folder each was saved in."""
    python = megatron_python(MEGATRON_CACHE)
    folders = write_cases(python, SAVE_SCRIPT, root, CASES, timeout=1200)
    folders[VLM_CASE] = write_qwen2_5_vl(os.path.join(root, VLM_CASE), python)
    return folders


def source_of(folder: str) -> tuple[str, list[str]]:
    """`--src` for a saved case, as its trainer's users point at it, and the options it needs."""
    if os.path.exists(os.path.join(folder, "latest_checkpointed_iteration.txt")):
        return folder, ["--hf-config", os.path.join(folder, "hf")]  # Megatron-LM saves no config
    return os.path.join(folder, "actor"), []
