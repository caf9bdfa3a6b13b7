"""Real FSDP2 checkpoints for the tests and benchmarks, written by real gloo ranks: verl rank
files (`torch.save` of each rank's DTensor shards) and PyTorch Distributed Checkpoints
(`torch.distributed.checkpoint.save`, as torchtitan, accelerate and FSDP2 training loops save).

Every writer starts its ranks, shards and saves through `rayexport.demo` (`run_gloo_ranks`,
`fully_shard_model`, `save_rank_state`), the code `python -m rayexport.run --demo` runs too.
Each returns what a faithful export must reproduce.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import tempfile
from dataclasses import dataclass

import torch

from rayexport.common.dtypes import dtype_of
from rayexport.demo import fully_shard_model, run_gloo_ranks, save_rank_state, write_fsdp_config, write_hf_folder
from rayexport.layouts.verl import rank_file_name
from support.models import (
    PROMPT_IDS, build_format_model, build_model, model_of, reference_logits, saved_state, tiny_format_config,
    with_random_lora,
)


@dataclass(frozen=True)
class ModelSave:
    """One checkpoint every rank saves: the model of the HF folder `config_dir` (a PeftModel
    when `lora` is given) holding the weights `weights` (a `torch.save`d state dict), sharded
    on a ("fsdp",) mesh or a ("ddp", "fsdp") `mesh_shape`, and saved to `out_dir` in `layout`.

    `shard_tensors` shards the weights one by one on dim 0 (`distribute_tensor`, as FSDP2 shards
    each parameter) instead of through the model: for weights in a naming the model does not
    have. `lora_only` keeps only the adapters. For DCP, `prefix` nests the model state ("" flat,
    "model." as {"model": sd}, "app.model." as {"app": {"model": sd}}), `with_optimizer` adds an
    Adam state dict beside it, and `compiled` saves through torch.compile's wrapper (every key
    under `_orig_mod.`)."""

    config_dir: str
    weights: str
    out_dir: str
    layout: str = "verl"
    mesh_shape: tuple[int, ...] | None = None
    shard_tensors: bool = False
    lora: dict | None = None
    lora_only: bool = False
    prefix: str = "model."
    with_optimizer: bool = False
    compiled: bool = False


def save_models(saves: list[ModelSave], world_size: int) -> None:
    """Write `saves` with one set of `world_size` gloo ranks: starting ranks (each importing
    transformers) costs far more than saving a tiny model."""
    for save in saves:
        if save.layout == "dcp" and save.prefix not in ("", "model.", "app.model."):
            raise ValueError(f"unsupported prefix {save.prefix!r}")
        if save.with_optimizer and (save.layout != "dcp" or save.prefix == ""):
            raise ValueError("only a nested DCP checkpoint has a place for an optimizer state dict")
        os.makedirs(save.out_dir, exist_ok=True)
    run_gloo_ranks(world_size, _save_models_rank, saves)


def _save_models_rank(rank: int, world_size: int, saves: list[ModelSave]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    for save in saves:
        shape = save.mesh_shape or (world_size,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("ddp", "fsdp") if len(shape) == 2 else ("fsdp",))
        weights = torch.load(save.weights, weights_only=True)
        if save.shard_tensors:
            from torch.distributed.tensor import Shard, distribute_tensor

            state = {name: distribute_tensor(tensor, mesh, [Shard(0)] if tensor.dim() else []) for name, tensor in weights.items()}
            optimizer_state = None
        else:
            state, optimizer_state = _model_state(save, weights, mesh)
        if save.layout == "dcp":
            state = _nested(state, optimizer_state, save.prefix)
        save_rank_state(state, save.out_dir, rank, world_size, save.layout)


def _model_state(save: ModelSave, weights: dict[str, torch.Tensor], mesh) -> tuple[dict, dict | None]:
    """The sharded model's state dict, and with `with_optimizer` its Adam state dict."""
    from transformers import AutoConfig

    model = model_of(AutoConfig.from_pretrained(save.config_dir, trust_remote_code=True))
    if save.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **save.lora))
    model.load_state_dict(weights)
    model = fully_shard_model(model, mesh)
    if save.compiled:
        model = torch.compile(model)  # compiles on the first call only; saving needs none
    if save.with_optimizer:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # lr=0 gives Adam real moment tensors while leaving the weights bit-identical, so the
        # saved model still equals the reference.
        optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
        model(input_ids=torch.tensor(PROMPT_IDS)).logits.float().pow(2).mean().backward()
        optimizer.step()
        return get_state_dict(model, optimizer)
    state = model.state_dict()
    if save.lora_only:
        state = {name: tensor for name, tensor in state.items() if ".lora_" in name}
    return state, None


def _nested(state: dict, optimizer_state: dict | None, prefix: str) -> dict:
    """A DCP save's state dict: the model state, and any optimizer state beside it, under `prefix`."""
    if prefix == "":
        return state
    parts = {"model": state} if optimizer_state is None else {"model": state, "optim": optimizer_state}
    return parts if prefix == "model." else {"app": parts}


# --- verl ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenCheckpoint:
    """A written checkpoint, with what a faithful export must reproduce: the original model's
    logits on `PROMPT_IDS` and its state dict (LoRA merged by peft itself)."""

    path: str
    world_size: int
    logits: torch.Tensor
    reference_state: dict[str, torch.Tensor]
    adapter_state: dict[str, torch.Tensor] | None = None
    base_model: str | None = None


@dataclass(frozen=True)
class VerlJob:
    """One checkpoint for `write_verl_checkpoints`: `write_verl_checkpoint`'s arguments."""

    config: object
    out_dir: str
    world_size: int = 2
    mesh_shape: tuple[int, ...] | None = None
    seed: int = 0
    lora: dict | None = None
    lora_only: bool = False
    code_files: dict[str, str] | None = None


def write_verl_checkpoint(config, out_dir: str, **job: object) -> WrittenCheckpoint:
    """Write a verl-layout FSDP2 checkpoint of `build_model(config, seed)` with `world_size`
    gloo ranks.

    `mesh_shape` (ddp, fsdp) gives an HSDP mesh; by default a 1-D ("fsdp",) mesh. `lora`
    (peft `LoraConfig` arguments) wraps the model in a PeftModel with non-zero adapters, as a
    verl LoRA run saves it; with `lora_only` the rank files hold only the adapters and the base
    model is saved as a Hugging Face folder beside the checkpoint. `code_files` (name -> source)
    are a remote-code model's files, saved beside its config.json.
    """
    return write_verl_checkpoints({out_dir: VerlJob(config, out_dir, **job)})[out_dir]


def write_verl_checkpoints(jobs: dict[str, VerlJob]) -> dict[str, WrittenCheckpoint]:
    """Write every job's checkpoint (as `write_verl_checkpoint`), the jobs of one world size
    with one set of gloo ranks; returns each job's checkpoint under its key."""
    with tempfile.TemporaryDirectory(prefix="rayexport-verl-") as scratch:
        prepared = {key: _prepare_verl(job, os.path.join(scratch, str(index))) for index, (key, job) in enumerate(jobs.items())}
        for world_size in sorted({job.world_size for job in jobs.values()}):
            save_models([prepared[key][1] for key, job in jobs.items() if job.world_size == world_size], world_size)
    return {key: _finish_verl(job, *prepared[key][0]) for key, job in jobs.items()}


def _prepare_verl(job: VerlJob, scratch: str) -> tuple[tuple, ModelSave]:
    """Build the job's model (with its adapters and, for `lora_only`, its base model folder),
    take its reference logits and save its weights and config under `scratch` for the ranks."""
    os.makedirs(job.out_dir, exist_ok=True)
    model = build_model(job.config, job.seed)
    base_model_dir = None
    if job.lora_only:
        base_model_dir = job.out_dir.rstrip("/") + "-base"
        model.save_pretrained(base_model_dir)
        write_hf_folder(job.config, base_model_dir, job.code_files)
    adapter_state = None
    if job.lora:
        from peft.utils import get_peft_model_state_dict

        model = with_random_lora(model, job.lora, job.seed)
        adapter_state = {name: tensor.clone() for name, tensor in get_peft_model_state_dict(model).items()}
    logits = reference_logits(model)
    os.makedirs(scratch)
    weights, config_dir = os.path.join(scratch, "weights.pt"), os.path.join(scratch, "config")
    torch.save(model.state_dict(), weights)
    write_hf_folder(job.config, config_dir, job.code_files)
    save = ModelSave(config_dir, weights, job.out_dir, mesh_shape=job.mesh_shape, lora=job.lora, lora_only=job.lora_only)
    return (model, logits, adapter_state, base_model_dir), save


def _finish_verl(job: VerlJob, model, logits, adapter_state, base_model_dir) -> WrittenCheckpoint:
    """The files a verl run writes beside the rank files, and the reference a faithful export
    must reproduce (LoRA merged by peft itself)."""
    if job.lora:
        model = model.merge_and_unload()
        with open(os.path.join(job.out_dir, "lora_train_meta.json"), "w") as handle:
            json.dump({"r": job.lora["r"], "lora_alpha": job.lora["lora_alpha"], "task_type": "CAUSAL_LM"}, handle)
    write_fsdp_config(job.out_dir, job.world_size)
    if not job.lora_only:
        write_hf_folder(job.config, os.path.join(job.out_dir, "huggingface"), job.code_files)
    reference_state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return WrittenCheckpoint(job.out_dir, job.world_size, logits, reference_state, adapter_state, base_model_dir)


# --- DCP -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DcpJob:
    """One checkpoint for `write_dcp_checkpoints`: `ModelSave`'s DCP settings for
    `build_model(config, seed)`."""

    config: object
    out_dir: str
    prefix: str = "model."
    with_optimizer: bool = False
    seed: int = 0
    compiled: bool = False


@dataclass(frozen=True)
class WrittenDcp:
    """A DCP checkpoint as written: its folder, the DcpJob's prefix and optimizer, and what an
    export must reproduce (the model's state dict and its logits on `PROMPT_IDS`)."""

    path: str
    prefix: str
    with_optimizer: bool
    reference: dict[str, torch.Tensor]
    logits: torch.Tensor


def write_dcp_checkpoint(
    config, out_dir: str, world_size: int = 3, prefix: str = "model.", with_optimizer: bool = False, seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Write a DCP checkpoint of `build_model(config, seed)` with `world_size` FSDP2 gloo ranks,
    plus a `huggingface/` folder; return the model's logits on `PROMPT_IDS` and its state dict.
    `prefix` and `with_optimizer` are `ModelSave`'s."""
    return write_dcp_checkpoints([DcpJob(config, out_dir, prefix, with_optimizer, seed)], world_size)[0]


def write_dcp_checkpoints(jobs: list[DcpJob], world_size: int = 3) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """`write_dcp_checkpoint` for several checkpoints, with one set of rank processes."""
    results, saves = [], []
    with tempfile.TemporaryDirectory(prefix="rayexport-dcp-") as scratch:
        for number, job in enumerate(jobs):
            model = build_model(job.config, job.seed)
            results.append((
                reference_logits(model),
                {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
            ))
            weights = os.path.join(scratch, f"weights-{number}.pt")
            torch.save(model.state_dict(), weights)
            config_dir = os.path.join(scratch, f"config-{number}")
            write_hf_folder(job.config, config_dir)
            saves.append(ModelSave(config_dir, weights, job.out_dir, "dcp", prefix=job.prefix,
                                   with_optimizer=job.with_optimizer, compiled=job.compiled))
        save_models(saves, world_size)
    for job in jobs:
        write_hf_folder(job.config, os.path.join(job.out_dir, "huggingface"))
    return results


# --- models whose in-memory names differ from their on-disk format ------------------------------


@dataclass(frozen=True)
class FormatCheckpoint:
    """A written checkpoint and what its export must reproduce."""

    path: str
    architecture: str
    naming: str  # "in-memory", "on-disk", or "mixed" (layer 1's MoE experts on-disk, the rest in-memory)
    layout: str  # "verl" or "dcp"
    logits: torch.Tensor
    saved_shapes: dict[str, tuple[int, ...]]  # save_pretrained's keys and shapes
    memory_shapes: dict[str, tuple[int, ...]]  # model.state_dict()'s, tied aliases dropped
    saved_config: dict  # the config.json save_pretrained writes


def write_format_checkpoints(
    root: str, cases: list[tuple[str, str, str]], world_size: int = 2, config_of=tiny_format_config,
) -> dict:
    """Checkpoints of `config_of(architecture)` models for (architecture, naming, layout) cases,
    all written by one set of gloo ranks; returns {case: FormatCheckpoint}.

    The in-memory naming is what a run under transformers 5 saves: the model itself, sharded by
    `fully_shard`. The on-disk naming is what a run under transformers 4 saved (per-expert MoE
    tensors, `model.*` + `visual.*`): the tensors `save_pretrained` writes, sharded one by one."""
    written, saves = {}, []
    with tempfile.TemporaryDirectory(prefix="rayexport-formats-") as scratch:
        for architecture in sorted({case[0] for case in cases}):
            config = config_of(architecture)
            model = build_format_model(config)
            memory = model.state_dict()
            saved, saved_config = saved_state(model)
            kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
            config_dir = os.path.join(scratch, architecture)
            write_hf_folder(config, config_dir)
            mixed = {name: tensor for name, tensor in memory.items() if ".layers.1.mlp.experts." not in name}
            mixed.update({name: tensor for name, tensor in saved.items() if ".layers.1.mlp.experts." in name})
            weights = {}
            for naming, state in (("in-memory", memory), ("on-disk", saved), ("mixed", mixed)):
                weights[naming] = os.path.join(scratch, f"{architecture}-{naming}.pt")
                torch.save(state, weights[naming])
            for case in cases:
                if case[0] != architecture:
                    continue
                _, naming, layout = case
                out_dir = os.path.join(root, "-".join(case))
                write_hf_folder(config, os.path.join(out_dir, "huggingface"))
                saves.append(ModelSave(config_dir, weights[naming], out_dir, layout, shard_tensors=naming != "in-memory"))
                written[case] = FormatCheckpoint(
                    out_dir, architecture, naming, layout, reference_logits(model),
                    {name: tuple(tensor.shape) for name, tensor in saved.items()},
                    {name: tuple(tensor.shape) for name, tensor in memory.items() if name in kept},
                    saved_config,
                )
        save_models(saves, world_size)
    for checkpoint in written.values():
        if checkpoint.layout == "verl":
            write_fsdp_config(checkpoint.path, world_size)
    return written


# --- random weights of any size ------------------------------------------------------------------


def write_synthetic_checkpoint(
    config, out_dir: str, world_size: int = 4, layout: str = "verl", one_rank_at_a_time: bool = False,
    conditioned: bool = False,
) -> int:
    """An FSDP2 checkpoint of random weights for `config`, written by `world_size` gloo ranks,
    each creating only its own Shard(0) slices (no process holds the model): verl rank files, or
    with `layout="dcp"` a DCP checkpoint (model state under "model."). `one_rank_at_a_time`
    (verl) has the ranks make and save their slices in turn, so that only one rank's share is
    in memory at once (a checkpoint larger than this machine's memory). Weights are standard
    normal, or with `conditioned` as a model is initialised (matrices of std 0.02, vectors of
    ones), whose forward pass two engines compute alike (standard normal weights through many
    layers make every rounding difference grow). Returns the bytes of its rank files."""
    if layout == "dcp" and one_rank_at_a_time:
        raise ValueError("a DCP checkpoint is saved by every rank at once")
    os.makedirs(out_dir, exist_ok=True)
    run_gloo_ranks(world_size, _save_synthetic_rank, config, out_dir, layout, one_rank_at_a_time, conditioned)
    write_hf_folder(config, os.path.join(out_dir, "huggingface"))
    if layout == "dcp":
        return sum(os.path.getsize(os.path.join(out_dir, name)) for name in os.listdir(out_dir) if name.endswith(".distcp"))
    write_fsdp_config(out_dir, world_size)
    return sum(os.path.getsize(os.path.join(out_dir, rank_file_name(world_size, rank))) for rank in range(world_size))


def _save_synthetic_rank(
    rank: int, world_size: int, config, out_dir: str, layout: str, one_rank_at_a_time: bool, conditioned: bool,
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for turn in range(world_size) if one_rank_at_a_time else [rank]:
        if turn == rank:
            state = _synthetic_shards(rank, world_size, mesh, config, conditioned)
            save_rank_state({"model": state} if layout == "dcp" else state, out_dir, rank, world_size, layout)
            del state
            if one_rank_at_a_time:  # glibc keeps a freed share in the heap, where the next rank's would add to it
                ctypes.CDLL(None).malloc_trim(0)
        dist.barrier()


def _synthetic_shards(rank: int, world_size: int, mesh, config, conditioned: bool) -> dict[str, torch.Tensor]:
    """This rank's Shard(0) slice of every tensor of `config`'s model, random (see
    `write_synthetic_checkpoint` for `conditioned`)."""
    from torch.distributed.tensor import DTensor, Shard

    from rayexport.model.description import build_meta_model, expected_tensors

    generator = torch.Generator().manual_seed(rank)
    dtype = dtype_of(str(config.dtype).removeprefix("torch."))
    state = {}
    for name, (shape, _) in sorted(expected_tensors(build_meta_model(config, False)).items()):
        rows = math.ceil(shape[0] / world_size)
        start, stop = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
        local = torch.randn((stop - start, *shape[1:]), generator=generator)
        if conditioned:
            local = local.mul_(0.02) if len(shape) > 1 else torch.ones_like(local)
        local = local.to(dtype)
        stride = tuple(math.prod(shape[dim + 1:]) for dim in range(len(shape)))
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    return state
