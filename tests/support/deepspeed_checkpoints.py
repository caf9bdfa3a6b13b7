"""The DeepSpeed ZeRO checkpoints the session's tests share: each written once, by DeepSpeed's own
engine (`deepspeed_save.py`, run with the Python of `deepspeed_env.deepspeed_python`), into a
folder of its own, with DeepSpeed's own conversion beside it (`reference/`)."""

from __future__ import annotations

import os

from support.deepspeed_env import deepspeed_python
from support.virtualenvs import DEEPSPEED_CACHE, write_cases

SAVE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_save.py")

# name: deepspeed_save.py's arguments; each a different way ZeRO partitions or a trainer lays out the save
CASES = {
    "zero1-fp16-untied": ["--stage", "1", "--untied", "--dtype", "float16"],
    "zero2-tied-two-groups": ["--stage", "2", "--tied", "--groups", "2"],
    "zero2-bf16-untied-openrlhf": ["--stage", "2", "--untied", "--dtype", "bfloat16", "--layout", "openrlhf"],
    "zero3-untied-world3-two-groups": ["--stage", "3", "--untied", "--world", "3", "--groups", "2"],
    "zero3-bf16-tied-zero-init": ["--stage", "3", "--tied", "--dtype", "bfloat16", "--zero-init"],
    "zero2-lora": ["--stage", "2", "--untied", "--lora"],
    "zero3-lora": ["--stage", "3", "--untied", "--lora"],
    # transformers 5's fused experts, flattened into runs that cut through experts and ranks
    "zero1-bf16-qwen3-moe-world3": ["--stage", "1", "--model", "qwen3_moe", "--untied", "--dtype", "bfloat16", "--world", "3"],
    "zero2-bf16-mixtral-world3-tied": ["--stage", "2", "--model", "mixtral", "--tied", "--dtype", "bfloat16", "--world", "3"],
    "zero3-bf16-mixtral-world3-two-groups": ["--stage", "3", "--model", "mixtral", "--untied", "--dtype", "bfloat16",
                                             "--world", "3", "--groups", "2"],
    # served by the vLLM check (tests/test_serving_vllm.py)
    "zero3-bf16-qwen3-moe-world3-zero-init-serving": ["--stage", "3", "--model", "qwen3_moe", "--untied", "--dtype", "bfloat16",
                                                      "--world", "3", "--zero-init", "--serving"],
}
MOE_CASES = [case for case, arguments in CASES.items() if "--model" in arguments]


def write_deepspeed_checkpoints(root: str) -> dict[str, str]:
    """Every case of `CASES` saved under `root`, by name, by one DeepSpeed process; the folder
    each was saved in."""
    return write_cases(deepspeed_python(DEEPSPEED_CACHE), SAVE_SCRIPT, root, CASES, timeout=900)


def source_of(folder: str) -> tuple[str, list[str]]:
    """`--src` for a saved case, as its trainer's users point at it, and the options it needs."""
    if os.path.isdir(os.path.join(folder, "_actor")):
        return os.path.join(folder, "_actor"), ["--hf-config", os.path.join(folder, "hf")]  # OpenRLHF keeps it apart
    return os.path.join(folder, "checkpoint-2"), []
