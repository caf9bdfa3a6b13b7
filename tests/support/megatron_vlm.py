"""A Qwen2.5-VL checkpoint in Megatron-Core's torch_dist layout, made from mbridge's own conversion
of a tiny Hugging Face model (`mbridge_conversion.py`, run with the Megatron virtualenv's Python):
mbridge's Qwen2.5-VL model cannot be built on CPU (docs/layouts.md says why), so Megatron-Core's
save is stood in for by its tensors, each layer's stacked on a leading axis per tower
(`language_model.decoder.layers.X`, `vision_model.decoder.layers.X`) as `dist_checkpointing.save`
stacks them, written with torch DCP beside Megatron's `metadata.json`, laid out as verl's
Megatron backend saves (`actor/dist_ckpt/`, `actor/huggingface/` with the image processor).

`reference/` holds mbridge's export of those tensors and the Hugging Face model's own outputs:
text logits on `PROMPT_IDS` and the vision tower's image features on `pixels()`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import torch

from support.models import PROMPT_IDS, build_format_model, tiny_format_config

CONVERSION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mbridge_conversion.py")
# What Megatron-Core 0.16.1 writes to metadata.json (its `CheckpointingConfig`)
TORCH_DIST = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
GRID = [[1, 4, 4]]  # one image of 4 x 4 patches (one frame)
_PER_LAYER = re.compile(r"^(?P<tower>\w+\.decoder\.layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")


def pixels(config) -> torch.Tensor:
    """The image input of the reference outputs: a patch row each, as the image processor makes them."""
    vision = config.vision_config
    patches = GRID[0][0] * GRID[0][1] * GRID[0][2]
    return torch.randn(patches, 3 * vision.temporal_patch_size * vision.patch_size ** 2, generator=torch.Generator().manual_seed(1))


def outputs(model) -> dict[str, torch.Tensor]:
    """What an export of the model must compute: its text logits and its image features."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT_IDS)).logits
        features = model.model.get_image_features(pixels(model.config), torch.tensor(GRID)).pooler_output
    return {"logits": logits, "image_features": torch.cat(features)}  # one tensor per image


def stacked_layers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-layer Megatron-Core tensors (`<tower>.decoder.layers.<L>.X`) stacked on a leading
    layer axis (`<tower>.decoder.layers.X`), as Megatron-Core saves a tower of like layers."""
    layers: dict[str, dict[int, torch.Tensor]] = {}
    state = {}
    for name, tensor in tensors.items():
        found = _PER_LAYER.match(name)
        if found is None:
            state[name] = tensor
        else:
            layers.setdefault(found["tower"] + found["rest"], {})[int(found["layer"])] = tensor
    for name, by_layer in layers.items():
        assert sorted(by_layer) == list(range(len(by_layer))), name
        state[name] = torch.stack([by_layer[layer] for layer in range(len(by_layer))])
    return state


def write_qwen2_5_vl(folder: str, megatron_python: str) -> str:
    """The checkpoint under `folder` (its `actor/` the source to export); returns `folder`."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2VLImageProcessorPil

    config = tiny_format_config("qwen2_5_vl")
    model = build_format_model(config)
    hf, reference = os.path.join(folder, "hf"), os.path.join(folder, "reference")
    model.save_pretrained(hf)
    Qwen2VLImageProcessorPil().save_pretrained(hf)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    subprocess.run(
        [megatron_python, CONVERSION, "--config", os.path.join(hf, "config.json"),
         "--hf", os.path.join(hf, "model.safetensors"), "--out", reference],
        check=True, timeout=600, env=env,
    )
    save_file(outputs(model), os.path.join(reference, "outputs.safetensors"))
    dist_ckpt = os.path.join(folder, "actor", "dist_ckpt")
    os.makedirs(dist_ckpt)
    dcp.save(stacked_layers(load_file(os.path.join(reference, "megatron.safetensors"))), checkpoint_id=dist_ckpt, no_dist=True)
    with open(os.path.join(dist_ckpt, "metadata.json"), "w") as f:
        json.dump(TORCH_DIST, f)
    shutil.copytree(hf, os.path.join(folder, "actor", "huggingface"), ignore=shutil.ignore_patterns("*.safetensors"))
    return folder
