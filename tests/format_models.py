"""Tiny models whose in-memory names differ from their on-disk format (MoE, vision-language),
and real FSDP2 checkpoints of them in both namings, written by gloo ranks.

The in-memory naming is what a run under transformers 5 saves: the model itself, sharded by
`fully_shard`. The on-disk naming is what a run under transformers 4 saved (per-expert MoE
tensors, `model.*` + `visual.*`): the tensors `save_pretrained` writes, sharded on dim 0 with
`distribute_tensor` as FSDP2 shards every parameter.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import torch

from rayexport.demo import PROMPT_IDS, _transformer_blocks, write_hf_folder

TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=128, dtype="float32")
VISION_ROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}


def tiny_format_config(architecture: str):
    """A tiny (hidden 64, 2 layers) config of `architecture`."""
    import transformers

    if architecture == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**TEXT, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, head_dim=16, tie_word_embeddings=False)
        config.architectures = ["Qwen3MoeForCausalLM"]
    elif architecture == "mixtral":
        config = transformers.MixtralConfig(**TEXT, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                            tie_word_embeddings=False)
        config.architectures = ["MixtralForCausalLM"]
    elif architecture == "deepseek_v3":  # one dense layer, then one MoE layer
        config = transformers.DeepseekV3Config(
            **dict(TEXT, num_key_value_heads=4), intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=False,
        )
        config.architectures = ["DeepseekV3ForCausalLM"]
    elif architecture == "qwen2_vl":
        config = transformers.Qwen2VLConfig(
            text_config=dict(TEXT, intermediate_size=128, rope_scaling=VISION_ROPE, tie_word_embeddings=False),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2),
        )
        config.architectures = ["Qwen2VLForConditionalGeneration"]
    elif architecture == "qwen2_5_vl":  # tied, declared only in text_config
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(TEXT, intermediate_size=128, rope_scaling=VISION_ROPE, tie_word_embeddings=True),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, fullatt_block_indexes=[1]),
        )
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    elif architecture == "qwen3":
        config = transformers.Qwen3Config(**TEXT, intermediate_size=128, head_dim=16, tie_word_embeddings=True)
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        raise ValueError(f"unknown architecture {architecture!r}")
    return config


def build_format_model(config, seed: int = 0) -> torch.nn.Module:
    """The model of `config` with deterministic random weights, norms moved off 1.0 and
    routers made decisive, so a swapped expert or tensor changes the logits."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])._from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith("gate.weight") or "experts" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.5)
    return model.eval()


def format_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT_IDS)).logits


def saved_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and config.json `save_pretrained` writes for `model`: its on-disk format."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        state = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(folder, name)))
        with open(os.path.join(folder, "config.json")) as handle:
            return state, json.load(handle)


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


def write_format_checkpoints(root: str, cases: list[tuple[str, str, str]], world_size: int = 2) -> dict:
    """Checkpoints for (architecture, naming, layout) cases, all written by one set of gloo
    ranks; returns {case: FormatCheckpoint}."""
    import torch.multiprocessing as multiprocessing

    written, jobs = {}, []
    with tempfile.TemporaryDirectory(prefix="rayexport-formats-") as scratch:
        for architecture in sorted({case[0] for case in cases}):
            config = tiny_format_config(architecture)
            model = build_format_model(config)
            memory = model.state_dict()
            saved, saved_config = saved_state(model)
            kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
            config_dir = os.path.join(scratch, architecture)
            write_hf_folder(config, config_dir)
            states = {}
            mixed = {name: tensor for name, tensor in memory.items() if ".layers.1.mlp.experts." not in name}
            mixed.update({name: tensor for name, tensor in saved.items() if ".layers.1.mlp.experts." in name})
            for naming, state in (("in-memory", memory), ("on-disk", saved), ("mixed", mixed)):
                path = os.path.join(scratch, f"{architecture}-{naming}.pt")
                torch.save(state, path)
                states[naming] = path
            for case in cases:
                if case[0] != architecture:
                    continue
                _, naming, layout = case
                out_dir = os.path.join(root, "-".join(case))
                os.makedirs(out_dir, exist_ok=True)
                jobs.append((config_dir, states[naming], naming, layout, out_dir))
                write_hf_folder(config, os.path.join(out_dir, "huggingface"))
                written[case] = FormatCheckpoint(
                    out_dir, architecture, naming, layout, format_logits(model),
                    {name: tuple(tensor.shape) for name, tensor in saved.items()},
                    {name: tuple(tensor.shape) for name, tensor in memory.items() if name in kept},
                    saved_config,
                )
        multiprocessing.spawn(_write_rank, args=(world_size, jobs, os.path.join(scratch, "rendezvous")), nprocs=world_size)
    for checkpoint in written.values():
        if checkpoint.layout == "verl":
            with open(os.path.join(checkpoint.path, "fsdp_config.json"), "w") as handle:
                json.dump({"FSDP_version": 2, "world_size": world_size}, handle)
    return written


def _write_rank(rank: int, world_size: int, jobs: list, rendezvous: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
        for config_dir, state_path, naming, layout, out_dir in jobs:
            full = torch.load(state_path, weights_only=True)
            if naming == "in-memory":
                config = transformers.AutoConfig.from_pretrained(config_dir)
                model = getattr(transformers, config.architectures[0])._from_config(config)
                model.load_state_dict(full)
                for block in _transformer_blocks(model):
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                state = model.state_dict()
            else:
                state = {name: distribute_tensor(tensor, mesh, [Shard(0)] if tensor.dim() else []) for name, tensor in full.items()}
            if layout == "verl":
                torch.save(state, os.path.join(out_dir, f"model_world_size_{world_size}_rank_{rank}.pt"))
            else:
                dcp.save({"model": state}, checkpoint_id=out_dir)
            dist.barrier()
    finally:
        dist.destroy_process_group()
