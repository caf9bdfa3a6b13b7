"""Real PyTorch Distributed Checkpoints (DCP) for the tests: FSDP2 gloo ranks calling
`torch.distributed.checkpoint.save`, as torchtitan, accelerate and FSDP2 training loops do."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch


def write_dcp_checkpoint(
    config,
    out_dir: str,
    world_size: int = 3,
    prefix: str = "model.",
    with_optimizer: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Write a DCP checkpoint of `rayexport.demo.build_model(config, seed)` with `world_size`
    FSDP2 gloo ranks, plus a `huggingface/` folder; return the model's logits on the demo
    prompt and its state dict.

    `prefix` nests the model state dict: "" saves it flat, "model." as {"model": sd}, and
    "app.model." as {"app": {"model": sd}}. `with_optimizer` adds an Adam state dict (with
    real exp_avg/exp_avg_sq/step tensors) beside the model, under "optim".
    """
    return write_dcp_checkpoints([DcpJob(config, out_dir, prefix, with_optimizer, seed)], world_size)[0]


@dataclass(frozen=True)
class DcpJob:
    """One checkpoint for `write_dcp_checkpoints`; the fields are `write_dcp_checkpoint`'s."""

    config: object
    out_dir: str
    prefix: str = "model."
    with_optimizer: bool = False
    seed: int = 0
    compiled: bool = False  # saved through torch.compile's wrapper: every key under `_orig_mod.`


def write_dcp_checkpoints(
    jobs: list[DcpJob], world_size: int = 3
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """`write_dcp_checkpoint` for several checkpoints with one set of rank processes: starting
    ranks (each importing transformers) costs far more than saving a tiny model."""
    import torch.multiprocessing as multiprocessing

    from rayexport.demo import build_model, reference_logits, write_hf_folder

    results = []
    with tempfile.TemporaryDirectory(prefix="rayexport-dcp-") as scratch:
        rank_jobs = []
        for number, job in enumerate(jobs):
            if job.prefix not in ("", "model.", "app.model."):
                raise ValueError(f"unsupported prefix {job.prefix!r}")
            if job.with_optimizer and job.prefix == "":
                raise ValueError("a flat checkpoint has no place for an optimizer state dict")
            os.makedirs(job.out_dir, exist_ok=True)
            model = build_model(job.config, job.seed)
            results.append((
                reference_logits(model),
                {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
            ))
            full_state = os.path.join(scratch, f"full-{number}.pt")
            torch.save(model.state_dict(), full_state)
            config_dir = os.path.join(scratch, f"config-{number}")
            write_hf_folder(job.config, config_dir)
            rank_jobs.append((config_dir, full_state, job.out_dir, job.prefix, job.with_optimizer, job.compiled))
        multiprocessing.spawn(
            _write_rank,
            args=(world_size, rank_jobs, os.path.join(scratch, "rendezvous")),
            nprocs=world_size,
        )
    for job in jobs:
        write_hf_folder(job.config, os.path.join(job.out_dir, "huggingface"))
    return results


def _write_rank(rank, world_size, rank_jobs, rendezvous) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        for job in rank_jobs:
            _save_one(world_size, *job)
    finally:
        dist.destroy_process_group()


def _save_one(world_size, config_dir, full_state, out_dir, prefix, with_optimizer, compiled) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from rayexport.demo import PROMPT_IDS, _transformer_blocks

    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(torch.load(full_state, weights_only=True))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for block in _transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if compiled:
        model = torch.compile(model)  # compiles on the first call only; saving needs none
    optimizer_state = None
    if with_optimizer:
        # lr=0 gives Adam real moment tensors while leaving the weights bit-identical, so the
        # saved model still equals the reference.
        optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
        model(input_ids=torch.tensor(PROMPT_IDS)).logits.float().pow(2).mean().backward()
        optimizer.step()
        model_state, optimizer_state = get_state_dict(model, optimizer)
    else:
        model_state = model.state_dict()
    if prefix == "":
        state = model_state
    elif prefix == "model.":
        state = {"model": model_state}
        if optimizer_state is not None:
            state["optim"] = optimizer_state
    else:
        state = {"app": {"model": model_state}}
        if optimizer_state is not None:
            state["app"]["optim"] = optimizer_state
    dcp.save(state, checkpoint_id=out_dir)
    dist.barrier()
