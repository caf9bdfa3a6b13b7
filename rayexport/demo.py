"""The embedded default for `python -m rayexport.run --demo`: a tiny model, and a real FSDP2
checkpoint of it written by real gloo ranks.

The tests' and benchmarks' checkpoint writers (tests/support/checkpoints.py) start their ranks,
shard and save with the functions here, so that everything rayexport is tested on is what
FSDP2 really saves, written one way.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from typing import Callable

import torch

from rayexport.layouts.verl import rank_file_name
from rayexport.orchestration.report import timed_stage

# How long a writer rank waits for the others (to join, or at a collective) before failing
# instead of hanging: long enough for the largest benchmark checkpoint's ranks, which write
# their shares in turn.
RANK_TIMEOUT = datetime.timedelta(hours=1)


def tiny_config(kind: str = "qwen2-tied", **overrides):
    """A small model config: `qwen2-tied` (tied head) or `llama-untied`."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, dtype="float32",
    )
    if kind == "qwen2-tied":
        config = Qwen2Config(**{"tie_word_embeddings": True, **common, **overrides})
        config.architectures = ["Qwen2ForCausalLM"]
    elif kind == "llama-untied":
        config = LlamaConfig(**{"tie_word_embeddings": False, **common, **overrides})
        config.architectures = ["LlamaForCausalLM"]
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    return config


def build_model(config, seed: int = 0) -> torch.nn.Module:
    """The model for `config` (the transformers class its `architectures` names, else remote
    code's causal LM) with deterministic random weights (no download)."""
    import transformers

    torch.manual_seed(seed)
    architecture = getattr(transformers, (config.architectures or [""])[0], None)
    if architecture is not None:
        model = architecture._from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    with torch.no_grad():  # move norms off 1.0 so a swapped or missing tensor changes logits
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def write_hf_folder(config, hf_dir: str, code_files: dict[str, str] | None = None) -> None:
    """config.json, generation_config.json, a small word-level tokenizer and any remote-code
    files, as verl saves them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    config.save_pretrained(hf_dir)
    for name, source in (code_files or {}).items():
        with open(os.path.join(hf_dir, name), "w") as handle:
            handle.write(source)
    GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=16).save_pretrained(hf_dir)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(100)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(hf_dir)


def run_gloo_ranks(world_size: int, rank_main: Callable, *args) -> None:
    """Run `rank_main(rank, world_size, *args)` in `world_size` new processes joined in one gloo
    process group, as a training job's ranks are; returns once all of them have saved and left
    the group. `rank_main` must be importable by name (a module-level function).

    The ranks are started with `spawn`, never forked from this process (which may run Ray's
    and moto's threads), and meet through a rendezvous file in a folder of their own, so no
    port is picked in advance and no rendezvous is shared with another writer."""
    import torch.multiprocessing as multiprocessing

    with tempfile.TemporaryDirectory(prefix="rayexport-ranks-") as scratch:
        multiprocessing.spawn(
            _gloo_rank, args=(world_size, os.path.join(scratch, "rendezvous"), rank_main, args), nprocs=world_size
        )


def _gloo_rank(rank: int, world_size: int, rendezvous: str, rank_main: Callable, args: tuple) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that dies of a signal leaves its Python stack on stderr
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size, timeout=RANK_TIMEOUT
    )
    try:
        rank_main(rank, world_size, *args)
        dist.barrier()  # no rank closes its connections while another still reads from them
    finally:
        dist.destroy_process_group()


def fully_shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """`fully_shard` each repeated transformer block, then the whole model, as FSDP2 training
    wraps a model; its state dict then holds this rank's DTensor shards."""
    from torch.distributed.fsdp import fully_shard

    blocks = [
        block
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "block", "h")
        for block in module
    ]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save_rank_state(state: dict, out_dir: str, rank: int, world_size: int, layout: str = "verl") -> None:
    """Save this rank's state: a verl rank file (`torch.save`), or with `layout="dcp"` this
    rank's part of a `torch.distributed.checkpoint` save (a collective of all the ranks)."""
    if layout == "verl":
        torch.save(state, os.path.join(out_dir, rank_file_name(world_size, rank)))
    elif layout == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=out_dir)
    else:
        raise ValueError(f"unknown layout {layout!r}")


def write_fsdp_config(out_dir: str, world_size: int) -> None:
    """The fsdp_config.json verl writes beside its rank files."""
    with open(os.path.join(out_dir, "fsdp_config.json"), "w") as handle:
        json.dump({"FSDP_version": 2, "world_size": world_size}, handle)


def write_verl_checkpoint(config, out_dir: str, world_size: int = 2) -> None:
    """A verl FSDP2 checkpoint of `build_model(config)`, saved by `world_size` gloo ranks, with
    its `huggingface/` folder."""
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rayexport-demo-") as scratch:
        weights, config_dir = os.path.join(scratch, "weights.pt"), os.path.join(scratch, "config")
        torch.save(build_model(config).state_dict(), weights)
        write_hf_folder(config, config_dir)
        run_gloo_ranks(world_size, _save_model_rank, config_dir, weights, out_dir)
    write_fsdp_config(out_dir, world_size)
    write_hf_folder(config, os.path.join(out_dir, "huggingface"))


def _save_model_rank(rank: int, world_size: int, config_dir: str, weights: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    model.load_state_dict(torch.load(weights, weights_only=True))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    save_rank_state(fully_shard_model(model, mesh).state_dict(), out_dir, rank, world_size)


def run_demo(options: "ExportOptions", seconds: dict[str, float] | None = None) -> "ExportReport":  # noqa: F821
    """Write a tiny tied-embedding FSDP2 checkpoint with 2 gloo ranks, then export and verify it
    with `options` (its `dst`, when empty, a folder beside the checkpoint; `seconds`: as
    `run_export` takes it)."""
    from rayexport.orchestration.job import run_export

    root = tempfile.mkdtemp(prefix="rayexport-demo-")
    source = os.path.join(root, "global_step_1", "actor")
    print(f"writing a tiny tied Qwen2-style FSDP2 checkpoint with 2 gloo ranks to {source}")
    with timed_stage(seconds if seconds is not None else {}, "demo_checkpoint"):
        write_verl_checkpoint(tiny_config("qwen2-tied"), source, world_size=2)
    options = dataclasses.replace(options, src=source, dst=options.dst or os.path.join(root, "export"))
    return run_export(options, seconds=seconds)
