"""A virtualenv with DeepSpeed, for the tests that write real ZeRO checkpoints with
`deepspeed_save.py` (DeepSpeed's own engine on CPU gloo ranks) beside DeepSpeed's own
conversion of each (`zero_to_fp32`'s `get_fp32_state_dict_from_zero_checkpoint`).

It lives under a cache folder that test sessions share, so that only the first session pays for
the install; torch itself is the test session's own (`virtualenvs.share_torch`), pinned in the
same resolution so that no dependency swaps in another build. `DS_BUILD_OPS=0` builds DeepSpeed
as pure Python: no op is compiled at install (the CPU accelerator compiles none the writer needs).
"""

from __future__ import annotations

import os
import subprocess

from support.virtualenvs import TORCH, cached_virtualenv

DEEPSPEED = "deepspeed==0.19.8"
# Besides DeepSpeed's own dependencies: transformers and peft for the models the writer trains
# (a LoRA case among them), safetensors for the references it writes.
DEPENDENCIES = ["transformers", "peft", "safetensors"]


def deepspeed_python(cache_dir: str) -> str:
    """The path of a Python with DeepSpeed 0.19.8 installed, in a virtualenv under `cache_dir`
    that this call creates when no earlier one has finished it."""

    def install(pip: list[str]) -> None:
        env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
        subprocess.run([*pip, TORCH, DEEPSPEED, *DEPENDENCIES], check=True, env=env)

    return cached_virtualenv(cache_dir, "deepspeed-0.19.8", install)
