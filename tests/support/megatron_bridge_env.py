"""A virtualenv with Megatron-Bridge 0.6.2 on Megatron-Core 0.19.2, what verl's Megatron backend,
NeMo-RL and slime save with in 2026, for the tests that write real `torch_dist` checkpoints with
`megatron_bridge_save.py` (Megatron-Bridge's own providers and `save_megatron_model`, on CPU gloo
ranks) beside Megatron-Bridge's own Hugging Face export of each, and for
`tools/megatron_bridge_tables.py`, which reads its mapping registries.

Both packages declare Python 3.12 and are installed without their declared dependencies
(`--ignore-requires-python --no-deps`: Megatron-Core has a cp311 wheel, and Megatron-Bridge's
code runs on 3.11 with `megatron_bridge_save.py`'s one alias); the dependencies they import are
listed below, transformers at Megatron-Bridge's pin. torch itself is the test session's own
(`virtualenvs.share_torch`), pinned in the same resolution so that no dependency swaps in a CUDA
build. No TransformerEngine, apex or grouped_gemm (CUDA only).
"""

from __future__ import annotations

import subprocess

from support.virtualenvs import TORCH, cached_virtualenv

MEGATRON_CORE, MEGATRON_BRIDGE = "megatron-core==0.19.2", "megatron-bridge==0.6.2"
# What Megatron-Core and Megatron-Bridge import on the paths the writer and the table script run:
# transformers at Megatron-Bridge's pin; `packaging>=24.2` for its version checks; einops,
# omegaconf, hydra-core, six, peft and accelerate, imported by its model and config modules;
# triton, imported unguarded by Megatron-Core's `moe/ops/paged_stash.py`; nvidia-modelopt,
# requests, datasets, megatron-energon, tensorboard and psutil, imported by `save_megatron_model`'s
# training modules; safetensors for the reference files; kernels at transformers 5.12.1's pin, which
# shadows the test session's newer one (transformers 5.12.1 fails to import beside that).
DEPENDENCIES = [
    "numpy", "packaging>=24.2", "transformers==5.12.1", "einops", "omegaconf", "hydra-core<1.4", "six", "peft",
    "accelerate", "triton", "nvidia-modelopt", "requests", "datasets", "megatron-energon~=7.0", "tensorboard",
    "psutil", "safetensors", "kernels>=0.12,<0.13",
]


def megatron_bridge_python(cache_dir: str) -> str:
    """The path of a Python with Megatron-Bridge 0.6.2 and Megatron-Core 0.19.2 installed, in a
    virtualenv under `cache_dir` that this call creates when no earlier one has finished it."""

    def install(pip: list[str]) -> None:
        subprocess.run([*pip, TORCH, *DEPENDENCIES], check=True)
        subprocess.run([*pip, "--no-deps", "--ignore-requires-python", MEGATRON_CORE, MEGATRON_BRIDGE], check=True)

    return cached_virtualenv(cache_dir, "megatron-bridge-0.6.2", install)
