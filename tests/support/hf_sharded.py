"""torch's sharded Hugging Face safetensors, written by real FSDP2 gloo ranks through
`torch.distributed.checkpoint.save` with `HuggingFaceStorageWriter(save_distributed=True)`, as
torchtitan's `last_save_in_hf` and NeMo Automodel's `model_save_format: safetensors` save them:
each rank writes `shard-{rank + 1}-model-{K}-of-{N}.safetensors` for each of N output files."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

from rayexport.demo import run_gloo_ranks, write_hf_folder
from support.checkpoints import ModelSave, _model_state
from support.models import build_model, reference_logits


@dataclass(frozen=True)
class ShardedJob:
    """One checkpoint of `build_model(config, seed)`, its tensors spread round-robin over `files`
    output files (the writer's `fqn_to_index_mapping`), saved into `out_dir`."""

    config: object
    out_dir: str
    files: int = 2
    seed: int = 0


@dataclass(frozen=True)
class ShardedCheckpoint:
    """A written checkpoint and what its export must reproduce: the model's logits on
    `PROMPT_IDS` and its state dict."""

    path: str
    logits: torch.Tensor
    reference_state: dict[str, torch.Tensor]


def write_hf_sharded_checkpoints(jobs: list[ShardedJob], world_size: int = 2) -> list[ShardedCheckpoint]:
    """Write `jobs` with one set of `world_size` gloo ranks (starting ranks costs far more than
    saving a tiny model)."""
    written, saves = [], []
    with tempfile.TemporaryDirectory(prefix="rayexport-hf-sharded-") as scratch:
        for number, job in enumerate(jobs):
            model = build_model(job.config, job.seed)
            state = model.state_dict()
            written.append(ShardedCheckpoint(job.out_dir, reference_logits(model), {k: v.detach().clone() for k, v in state.items()}))
            weights, config_dir = os.path.join(scratch, f"weights-{number}.pt"), os.path.join(scratch, f"config-{number}")
            torch.save(state, weights)
            write_hf_folder(job.config, config_dir)
            mapping = {key: 1 + position % job.files for position, key in enumerate(sorted(state))}
            saves.append((ModelSave(config_dir, weights, job.out_dir), mapping))
            os.makedirs(job.out_dir, exist_ok=True)
        run_gloo_ranks(world_size, _save_rank, saves)
    return written


def _save_rank(rank: int, world_size: int, saves: list[tuple[ModelSave, dict[str, int]]]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for save, mapping in saves:
        state, _ = _model_state(save, torch.load(save.weights, weights_only=True), mesh)
        writer = HuggingFaceStorageWriter(save.out_dir, save_distributed=True, fqn_to_index_mapping=mapping)
        dcp.save(state, storage_writer=writer)
