"""The embedded default: tiny models and real FSDP2 checkpoints written by real gloo ranks.

`python -m rayexport.run --demo` uses it end to end; the tests and the benchmark use the same
checkpoint writer, so what they export is what FSDP2 really saves.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass

import torch

from rayexport.dtypes import dtype_of
from rayexport.layouts.verl import rank_file_name

PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]


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
    """The model for `config` with deterministic random weights (no download)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    with torch.no_grad():  # move norms off 1.0 so a swapped or missing tensor changes logits
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def reference_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT_IDS)).logits


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


def write_verl_checkpoint(
    config,
    out_dir: str,
    world_size: int = 2,
    mesh_shape: tuple[int, ...] | None = None,
    seed: int = 0,
    lora: dict | None = None,
    lora_only: bool = False,
    code_files: dict[str, str] | None = None,
) -> WrittenCheckpoint:
    """Write a verl-layout FSDP2 checkpoint of a tiny model with `world_size` gloo ranks.

    `mesh_shape` (ddp, fsdp) gives an HSDP mesh; by default a 1-D ("fsdp",) mesh. `lora`
    (peft `LoraConfig` arguments) wraps the model in a PeftModel with non-zero adapters, as a
    verl LoRA run saves it; with `lora_only` the rank files hold only the adapters and the base
    model is saved as a Hugging Face folder beside the checkpoint. `code_files` (name -> source)
    are a remote-code model's files, saved beside its config.json.
    """
    import torch.multiprocessing as multiprocessing

    os.makedirs(out_dir, exist_ok=True)
    model = build_model(config, seed)
    base_model_dir = None
    if lora_only:
        base_model_dir = out_dir.rstrip("/") + "-base"
        model.save_pretrained(base_model_dir)
        write_hf_folder(config, base_model_dir, code_files)
    adapter_state = None
    if lora:
        model = _with_random_lora(model, lora, seed)
        from peft.utils import get_peft_model_state_dict

        adapter_state = {name: tensor.clone() for name, tensor in get_peft_model_state_dict(model).items()}
    logits = reference_logits(model)
    with tempfile.TemporaryDirectory(prefix="rayexport-demo-") as scratch:
        full_state = os.path.join(scratch, "full.pt")
        torch.save(model.state_dict(), full_state)
        config_dir = os.path.join(scratch, "config")
        write_hf_folder(config, config_dir, code_files)
        multiprocessing.spawn(
            _write_rank,
            args=(world_size, mesh_shape or (world_size,), config_dir, lora, lora_only, full_state,
                  out_dir, os.path.join(scratch, "rendezvous")),
            nprocs=world_size,
        )
    if lora:
        model = model.merge_and_unload()
        with open(os.path.join(out_dir, "lora_train_meta.json"), "w") as handle:
            json.dump({"r": lora["r"], "lora_alpha": lora["lora_alpha"], "task_type": "CAUSAL_LM"}, handle)
    with open(os.path.join(out_dir, "fsdp_config.json"), "w") as handle:
        json.dump({"FSDP_version": 2, "world_size": world_size}, handle)
    if not lora_only:
        write_hf_folder(config, os.path.join(out_dir, "huggingface"), code_files)
    reference_state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return WrittenCheckpoint(out_dir, world_size, logits, reference_state, adapter_state, base_model_dir)


def _with_random_lora(model: torch.nn.Module, lora: dict, seed: int) -> torch.nn.Module:
    """Wrap in a PeftModel whose A and B are random: peft initialises B to zero, which would
    make any merge look right."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return peft_model.eval()


def sized_llama_config(target_bytes: int, hidden_size: int = 1024, vocab_size: int = 32000, dtype: str = "bfloat16"):
    """An untied Llama config whose weights take about `target_bytes` in `dtype` (for
    benchmarks and memory tests: the number of layers is chosen to fit)."""
    from transformers import LlamaConfig

    intermediate = hidden_size * 11 // 4
    per_layer = 4 * hidden_size * hidden_size + 3 * hidden_size * intermediate + 2 * hidden_size
    fixed = 2 * vocab_size * hidden_size + hidden_size
    layers = max(1, round((target_bytes / dtype_of(dtype).itemsize - fixed) / per_layer))
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
        tie_word_embeddings=False, dtype=dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def write_synthetic_checkpoint(config, out_dir: str, world_size: int = 4, layout: str = "verl", one_rank_at_a_time: bool = False) -> int:
    """An FSDP2 checkpoint of random weights for `config`, written by `world_size` gloo ranks,
    each creating only its own Shard(0) slices (no process holds the model): verl rank files, or
    with `layout="dcp"` a DCP checkpoint saved by `torch.distributed.checkpoint.save` (model
    state under "model."). `one_rank_at_a_time` (verl) has the ranks make and save their slices
    in turn, so that only one rank's share is in memory at once (a checkpoint larger than this
    machine's memory). Returns the bytes of its rank files."""
    from torch import multiprocessing

    if layout == "dcp" and one_rank_at_a_time:
        raise ValueError("a DCP checkpoint is saved by every rank at once")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        multiprocessing.spawn(
            _write_synthetic_rank,
            args=(world_size, os.path.join(scratch, "rendezvous"), config, out_dir, layout, one_rank_at_a_time),
            nprocs=world_size,
        )
    write_hf_folder(config, os.path.join(out_dir, "huggingface"))
    if layout == "dcp":
        return sum(os.path.getsize(os.path.join(out_dir, name)) for name in os.listdir(out_dir) if name.endswith(".distcp"))
    with open(os.path.join(out_dir, "fsdp_config.json"), "w") as handle:
        json.dump({"FSDP_version": 2, "world_size": world_size}, handle)
    return sum(os.path.getsize(os.path.join(out_dir, rank_file_name(world_size, rank))) for rank in range(world_size))


def _write_synthetic_rank(
    rank: int, world_size: int, rendezvous: str, config, out_dir: str, layout: str, one_rank_at_a_time: bool
) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=3600),
    )
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
        for turn in range(world_size) if one_rank_at_a_time else [rank]:
            if turn == rank:
                state = _synthetic_shards(rank, world_size, mesh, config)
                if layout == "dcp":
                    import torch.distributed.checkpoint as dcp

                    dcp.save({"model": state}, checkpoint_id=out_dir)
                else:
                    torch.save(state, os.path.join(out_dir, rank_file_name(world_size, rank)))
                del state
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _synthetic_shards(rank: int, world_size: int, mesh, config) -> dict[str, torch.Tensor]:
    """This rank's Shard(0) slice of every tensor of `config`'s model, random."""
    from torch.distributed.tensor import DTensor, Shard

    from rayexport.model import build_meta_model, expected_tensors

    generator = torch.Generator().manual_seed(rank)
    dtype = dtype_of(str(config.dtype).removeprefix("torch."))
    state = {}
    for name, (shape, _) in sorted(expected_tensors(build_meta_model(config, False)).items()):
        rows = math.ceil(shape[0] / world_size)
        start, stop = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
        local = torch.randn((stop - start, *shape[1:]), generator=generator).to(dtype)
        stride = tuple(math.prod(shape[dim + 1:]) for dim in range(len(shape)))
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    return state


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


def _write_rank(rank, world_size, mesh_shape, config_dir, lora, lora_only, full_state, out_dir, rendezvous) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        config = AutoConfig.from_pretrained(config_dir, trust_remote_code=True)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
        model.load_state_dict(torch.load(full_state, weights_only=True))
        names = ("ddp", "fsdp") if len(mesh_shape) == 2 else ("fsdp",)
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
        for block in _transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        if lora_only:
            state = {name: tensor for name, tensor in state.items() if ".lora_" in name}
        torch.save(state, os.path.join(out_dir, f"model_world_size_{world_size}_rank_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP wraps one by one (`layers`, `block` or `h` module lists)."""
    return [
        block
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "block", "h")
        for block in module
    ]


def run_demo(destination: str | None = None, workers: int = 2, **options) -> "ExportReport":  # noqa: F821
    """Write a tiny tied-embedding FSDP2 checkpoint with 2 gloo ranks, export and verify it."""
    from rayexport.job import export

    root = tempfile.mkdtemp(prefix="rayexport-demo-")
    source = os.path.join(root, "global_step_1", "actor")
    print(f"writing a tiny tied Qwen2-style FSDP2 checkpoint with 2 gloo ranks to {source}")
    write_verl_checkpoint(tiny_config("qwen2-tied"), source, world_size=2)
    return export(source, destination or os.path.join(root, "export"), workers=workers, **options)
