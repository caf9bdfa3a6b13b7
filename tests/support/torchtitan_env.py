"""Virtualenvs with torchtitan, for the tests that write real torchtitan checkpoints with
`torchtitan_save.py` (torchtitan's own code, on CPU).

Each torchtitan version gets a virtualenv of its own under a cache folder that test sessions
share, so that only the first session pays for the install (0.3.0: 24 s and 1.1 GiB, most of it triton;
torch itself is the test session's own, see `virtualenvs.share_torch`). torchtitan is installed without
its declared dependencies (wandb, tensorboard, datasets...): only what the import path of its
model classes, FSDP2 helper, CheckpointManager and state dict adapters needs, with torch pinned
in the same resolution so that no dependency can swap in another (CUDA) build.
"""

from __future__ import annotations

import subprocess

from support.virtualenvs import TORCH, cached_virtualenv

# Besides torch: triton, imported and not declared; numpy, for torch.distributed's object
# collectives; safetensors, for the reference files; 0.2's model packages import its dataset,
# tokenizer and metrics modules.
DEPENDENCIES = {
    "0.3.0": ["spmd_types==0.2.3", "tyro", "torchdata", "triton", "numpy", "safetensors"],
    "0.2.2": ["tyro", "torchdata", "triton", "numpy", "safetensors", "datasets", "tokenizers", "tensorboard"],
}


def torchtitan_python(cache_dir: str, version: str = "0.3.0") -> str:
    """The path of a Python with torchtitan `version` installed, in a virtualenv under
    `cache_dir` that this call creates when no earlier one has finished it."""

    def install(pip: list[str]) -> None:
        subprocess.run([*pip, TORCH, *DEPENDENCIES[version]], check=True)
        subprocess.run([*pip, "--no-deps", f"torchtitan=={version}"], check=True)

    return cached_virtualenv(cache_dir, f"torchtitan-{version}", install)
