"""Virtualenvs for the tests that run another package's own code (torchtitan, vLLM, Megatron-Core,
Megatron-Bridge, DeepSpeed), kept under a cache folder that test sessions share, so that only the first session
pays for the install.
Each sees the test session's own torch (`share_torch`) instead of installing a second copy."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from typing import Callable

TORCH = "torch==2.13.0"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where the tests keep each virtualenv (git ignores them).
TORCHTITAN_CACHE, VLLM_CACHE = os.path.join(REPO, ".venv-torchtitan"), os.path.join(REPO, ".venv-vllm")
MEGATRON_CACHE = os.path.join(REPO, ".venv-megatron")
DEEPSPEED_CACHE = os.path.join(REPO, ".venv-deepspeed")


def cached_virtualenv(cache_dir: str, name: str, install: Callable[[list[str]], None]) -> str:
    """The path of the Python of the virtualenv `name` under `cache_dir`, created (seeing this
    Python's torch) and handed to `install` (called with its `pip install` command) when no
    earlier call finished it. Another session building it at once waits for that one."""
    venv = os.path.join(cache_dir, name)
    python = os.path.join(venv, "bin", "python")
    installed = os.path.join(venv, "installed")
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(installed):
            subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
            share_torch(python)
            install([python, "-m", "pip", "install", "--quiet"])
            open(installed, "w").close()
    return python


def share_torch(python: str) -> None:
    """Let the new virtualenv see this Python's site-packages, after its own, so that pip finds
    the torch already installed here (the same build, by construction) instead of installing
    another: 24 s and 1.1 GiB for torchtitan 0.3.0's virtualenv, against 54 s and 2 GiB. What
    pip installs there comes first on its path."""
    import torch

    shared = os.path.dirname(os.path.dirname(torch.__file__))
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True,
    ).stdout.strip()
    with open(os.path.join(own, "shared-torch.pth"), "w") as handle:
        handle.write(shared + "\n")


def write_cases(python: str, script: str, root: str, cases: dict[str, list[str]], timeout: float) -> dict[str, str]:
    """Run writer `script` once with `python` (a virtualenv's), saving every case of `cases`
    (name: the script's arguments) into `root/<name>` (`--out`), all in one process through its
    `--batch FILE`; the folder of each case, by name. The session's Ray address is not passed on."""
    import json

    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    os.makedirs(root, exist_ok=True)
    folders = {name: os.path.join(root, name) for name in cases}
    batch = os.path.join(root, "cases.json")
    with open(batch, "w") as f:
        json.dump([["--out", folders[name], *arguments] for name, arguments in cases.items()], f)
    subprocess.run([python, script, "--batch", batch], check=True, timeout=timeout, env=env)
    return folders


def build_all() -> None:
    """Every virtualenv the tests use: `python tests/support/virtualenvs.py`, which CI starts
    beside the tests so that the builds overlap them (a test needing one waits for its build)."""
    from support.deepspeed_env import deepspeed_python
    from support.megatron_bridge_env import megatron_bridge_python
    from support.megatron_env import megatron_python
    from support.torchtitan_env import torchtitan_python
    from support.vllm_env import vllm_python

    # in the order the tests need them
    print(deepspeed_python(DEEPSPEED_CACHE), megatron_python(MEGATRON_CACHE), megatron_bridge_python(MEGATRON_CACHE),
          vllm_python(VLLM_CACHE), torchtitan_python(TORCHTITAN_CACHE), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `support`'s parent
    build_all()
