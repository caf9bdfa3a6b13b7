"""Virtualenvs with torchtitan, for the tests that write real torchtitan checkpoints with
`torchtitan_save.py` (torchtitan's own code, on CPU).

Each torchtitan version gets a virtualenv of its own under a cache folder that test sessions
share, so that only the first session pays for the install (0.3.0: 24 s and 1.1 GiB, most of it triton;
torch itself is the test session's own, see `_share_torch`). torchtitan is installed without
its declared dependencies (wandb, tensorboard, datasets...): only what the import path of its
model classes, FSDP2 helper, CheckpointManager and state dict adapters needs, with torch pinned
in the same resolution so that no dependency can swap in another (CUDA) build.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

TORCH = "torch==2.13.0"

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
    venv = os.path.join(cache_dir, f"torchtitan-{version}")
    python = os.path.join(venv, "bin", "python")
    installed = os.path.join(venv, "installed")
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        # Another test session may be installing the same version right now.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(installed):
            subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
            _share_torch(python)
            pip = [python, "-m", "pip", "install", "--quiet"]
            subprocess.run([*pip, TORCH, *DEPENDENCIES[version]], check=True)
            subprocess.run([*pip, "--no-deps", f"torchtitan=={version}"], check=True)
            open(installed, "w").close()
    return python


def _share_torch(python: str) -> None:
    """Let the new virtualenv see this Python's site-packages, after its own, so that pip finds
    the torch already installed here (the same build, by construction) instead of installing
    another: 24 s and 1.1 GiB for 0.3.0's virtualenv, against 54 s and 2 GiB. What pip installs
    there (torchtitan and the dependencies above) comes first on its path."""
    import torch

    shared = os.path.dirname(os.path.dirname(torch.__file__))
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True,
    ).stdout.strip()
    with open(os.path.join(own, "shared-torch.pth"), "w") as handle:
        handle.write(shared + "\n")
