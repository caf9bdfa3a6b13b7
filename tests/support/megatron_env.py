"""A virtualenv with Megatron-Core and mbridge, for the tests that write real Megatron `torch_dist`
checkpoints with `megatron_save.py` (Megatron-Core's own code, on CPU gloo ranks) beside mbridge's
own Hugging Face export of the same model (mbridge is verl's Megatron<->HF bridge).

It lives under a cache folder that test sessions share, so that only the first session pays for
the install (9 s and 43 MiB: 17 MiB of it Megatron-Core, 24 MiB the virtualenv's own pip and
setuptools); torch itself is the test session's own, see `virtualenvs.share_torch`, and pinned in
the same resolution so that no dependency can swap in another (CUDA) build. Megatron-Core and
mbridge are installed without their declared dependencies: Megatron-Core's are the three below,
and mbridge's `megatron` extra would re-resolve Megatron-Core unpinned. No TransformerEngine, apex
or grouped_gemm (CUDA only): `megatron_save.py` builds with Megatron's local layer spec.
"""

from __future__ import annotations

import subprocess

from support.virtualenvs import TORCH, cached_virtualenv

MEGATRON_CORE, MBRIDGE = "megatron-core==0.16.1", "mbridge==0.15.1"
# Besides torch: numpy and packaging, Megatron-Core's declared dependencies (its RNG state and
# version checks); psutil, which its checkpoint writer asks for while saving; einops, imported
# by mbridge's model package; transformers, for the Hugging Face configs mbridge builds from;
# safetensors, for mbridge's own IO and the reference files.
DEPENDENCIES = ["numpy", "packaging", "psutil", "einops", "transformers", "safetensors"]


def megatron_python(cache_dir: str) -> str:
    """The path of a Python with Megatron-Core 0.16.1 and mbridge 0.15.1 installed, in a
    virtualenv under `cache_dir` that this call creates when no earlier one has finished it."""

    def install(pip: list[str]) -> None:
        subprocess.run([*pip, TORCH, *DEPENDENCIES], check=True)
        subprocess.run([*pip, "--no-deps", MEGATRON_CORE, MBRIDGE], check=True)

    return cached_virtualenv(cache_dir, "megatron-core-0.16.1", install)
