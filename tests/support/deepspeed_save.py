"""Writes a real DeepSpeed ZeRO checkpoint of a tiny Hugging Face model, and DeepSpeed's own
conversion of it.

Run with a Python that `deepspeed_env.deepspeed_python` made (DeepSpeed 0.19.8, on CPU), not the
project's:

    python deepspeed_save.py --out DIR --stage 1|2|3 [--model llama|qwen3_moe|mixtral] [--serving]
        [--dtype float32|bfloat16|float16] --tied|--untied [--world N] [--zero-init] [--lora] [--layout trainer|openrlhf] [--steps N] [--groups 1|2]
    python deepspeed_save.py --batch FILE   # FILE: a JSON list of such argument lists

Everything that decides what lands on disk is DeepSpeed's own code: `deepspeed.initialize` of a
transformers Llama, Qwen3-MoE or Mixtral model (`--model`; odd sizes, so that ZeRO pads partitions
and parameters straddle ranks; `--serving`: sizes vLLM's CPU build serves)
with a client `torch.optim.AdamW` (with `--groups 2`, Trainer's two parameter groups), on `--world` gloo ranks (default 2), `--steps` training steps
(default 2), and `engine.save_checkpoint(dir, tag="global_step<steps>")`, which writes `latest`,
`zero_to_fp32.py` and the tag folder. ZeRO-3 partitions every parameter
(`stage3_param_persistence_threshold: 0`; a tiny model's would otherwise stay whole); with
`--zero-init` the model is built under `deepspeed.zero.Init`, as transformers' Trainer builds it
for ZeRO-3. `--lora` wraps it in peft's LoRA (q_proj, v_proj), so the base weights are frozen
parameters DeepSpeed saves apart. The folder is laid out as its trainer does:

- `--layout trainer` (default): `DIR/checkpoint-N/` is Trainer's: the DeepSpeed files with
  config.json beside `latest`;
- `--layout openrlhf`: `DIR/_actor/` holds the DeepSpeed files, and the config is apart, in
  `DIR/hf/` (OpenRLHF's `_hf` folder).

It also writes, from rank 0, what an export must reproduce: `DIR/reference/zero_to_fp32.safetensors`,
DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` of the saved checkpoint (its tied alias
left out, as safetensors holds a tensor once); `DIR/reference/save_pretrained/`, that state dict
loaded into the model and saved by `save_pretrained` (the on-disk format: per-expert tensors for a
MoE model); and `DIR/reference/files.json`, every file saved.

On CPU DeepSpeed needs `DS_ACCELERATOR=cpu`, and its comm backend would compile a shared-memory
all-reduce op (minutes) that only inference uses: `build_shm_op` is replaced, in this writer only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]
SEQ_LEN, BATCH, SEED, LR = 16, 2, 1234, 1e-2
RANK_TIMEOUT_S = 120
# Odd sizes: the embedding, the MLP and the norms have an odd number of elements, so ZeRO-3 pads
# their partitions, and ZeRO-1/2's flat buffers split a parameter between ranks.
SIZES = dict(vocab_size=97, hidden_size=35, intermediate_size=51, num_hidden_layers=2, num_attention_heads=5,
             num_key_value_heads=1, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu")
# vLLM's CPU attention runs head_dim 32 and up: the sizes of the save the vLLM check serves, whose
# larger initializer range gives decisive logits.
SERVING_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, max_position_embeddings=128, initializer_range=0.3)
# The MoE models, as transformers 5 holds them: each layer's experts fused into `gate_up_proj` and
# `down_proj`, which ZeRO flattens into runs that cut through experts (an odd number of them). Their
# hidden and expert sizes are multiples of 8, as the grouped matmul transformers runs them with
# needs 16-byte strides in 16-bit dtypes.
MOE_SIZES = dict(hidden_size=40)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=24, num_local_experts=5, num_experts_per_tok=2)),
}


def hf_config(args: argparse.Namespace):
    import transformers

    config_class, architecture, settings = MODELS[args.model]
    sizes = SERVING_SIZES if args.serving else dict(SIZES, **(MOE_SIZES if args.model != "llama" else {}))
    config = getattr(transformers, config_class)(**dict(sizes, **settings), tie_word_embeddings=args.tied, dtype=args.dtype)
    config.architectures = [architecture]
    return config


def ds_config(args: argparse.Namespace) -> dict:
    """DeepSpeed's config for the run: ZeRO `--stage`, the dtype, a client optimizer."""
    zero = {"stage": args.stage}
    if args.stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=False)
    config = {
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": zero, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1000, "wall_clock_breakdown": False,
    }
    if args.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif args.dtype == "float16":  # a dynamic loss scale, as fp16 training runs
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def build_model(args: argparse.Namespace, config: dict):
    """The transformers model (under `deepspeed.zero.Init` with `--zero-init`), in peft's LoRA with `--lora`."""
    import deepspeed
    import transformers

    torch.manual_seed(SEED)
    hf = hf_config(args)
    # the model's class is imported before `zero.Init` patches torch's tensor constructors, which
    # the torch modules it imports (torch._dynamo) would trip over
    model_class = getattr(transformers, hf.architectures[0])
    if args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = model_class(hf)
        # transformers' initialisation does not reach a fused experts tensor that ZeRO-3
        # partitioned as it was made: it kept torch.empty's bytes (NaN at times, which no export
        # compares equal). Rank 0 gives those values, as a trained model would have.
        experts = [param for name, param in model.named_parameters() if ".experts." in name]
        with deepspeed.zero.GatheredParameters(experts, modifier_rank=0):
            for param in experts:
                torch.nn.init.normal_(param, std=0.02)
    else:
        model = model_class(hf)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        for name, param in model.named_parameters():  # a trained adapter, so that a merge changes the weights
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
    return model


def parameter_groups(model, groups: int) -> list[dict]:
    """The optimizer's parameter groups: one, or two as transformers' Trainer makes them (weight
    decay for matrices, none for norms), so that ZeRO keeps a flat buffer per group."""
    trained = [param for param in model.parameters() if param.requires_grad]
    if groups == 1:
        return [{"params": trained}]

    def is_matrix(param):
        return len(getattr(param, "ds_shape", param.shape)) > 1
    return [{"params": [param for param in trained if is_matrix(param)], "weight_decay": 0.01},
            {"params": [param for param in trained if not is_matrix(param)], "weight_decay": 0.0}]


def checkpoint_dir(args: argparse.Namespace) -> str:
    return os.path.join(args.out, f"checkpoint-{args.steps}" if args.layout == "trainer" else "_actor")


def run_rank(rank: int, args: argparse.Namespace, world: int, rendezvous: str) -> None:
    """One gloo rank: train `--steps` steps and save with DeepSpeed's engine."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    torch.set_num_threads(1)
    import deepspeed

    # The CPU comm backend compiles a shared-memory all-reduce op for inference; training never uses it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if args.dtype == "float16":
        # DeepSpeed's CPU accelerator offers fp16 only where oneDNN has fp16 kernels (not this
        # machine's CPUs); torch's CPU float16 ops train the tiny model, slowly but exactly.
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    config = ds_config(args)
    model = build_model(args, config)
    optimizer = torch.optim.AdamW(parameter_groups(model, args.groups), lr=LR, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for step in range(1, args.steps + 1):
        generator = torch.Generator().manual_seed(SEED + 1000 * step + rank)
        tokens = torch.randint(SIZES["vocab_size"], (BATCH, SEQ_LEN), generator=generator)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step}: loss={loss.item():.4f}", flush=True)
    folder = checkpoint_dir(args)
    engine.save_checkpoint(folder, tag=f"global_step{args.steps}")
    dist.barrier()
    if rank == 0:
        write_references(args, folder)
    dist.barrier()
    dist.destroy_process_group()


def write_references(args: argparse.Namespace, folder: str) -> None:
    """DeepSpeed's own conversion of the saved checkpoint, that state dict saved in the model's
    on-disk format by `save_pretrained` (not for LoRA), and the config where its trainer keeps it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    state = get_fp32_state_dict_from_zero_checkpoint(folder, tag=f"global_step{args.steps}")
    seen, unique = set(), {}
    for name, tensor in state.items():  # a tied alias is the same tensor: kept once
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor.detach().clone().contiguous()
    reference = os.path.join(args.out, "reference")
    os.makedirs(reference, exist_ok=True)
    save_file(unique, os.path.join(reference, "zero_to_fp32.safetensors"))
    if not args.lora:
        model = AutoModelForCausalLM.from_config(hf_config(args), dtype=torch.float32)
        model.load_state_dict(state, strict=True)
        model.save_pretrained(os.path.join(reference, "save_pretrained"))
    files = sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names)
    with open(os.path.join(reference, "files.json"), "w") as f:
        json.dump(files, f, indent=1)
    hf = folder if args.layout == "trainer" else os.path.join(args.out, "hf")
    hf_config(args).save_pretrained(hf)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], required=True)
    parser.add_argument("--model", choices=list(MODELS), default="llama")
    parser.add_argument("--serving", action="store_true", help="sizes vLLM's CPU build serves")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    tying = parser.add_mutually_exclusive_group(required=True)
    tying.add_argument("--tied", dest="tied", action="store_true")
    tying.add_argument("--untied", dest="tied", action="store_false")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--zero-init", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--layout", choices=["trainer", "openrlhf"], default="trainer")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups", type=int, choices=[1, 2], default=1, help="optimizer parameter groups")
    args = parser.parse_args(argv)
    if args.zero_init and args.stage != 3:
        parser.error("--zero-init takes --stage 3")
    return args


def write(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="deepspeed-ranks-") as scratch:
        mp.start_processes(run_rank, args=(args, args.world, os.path.join(scratch, "rendezvous")), nprocs=args.world,
                           start_method="fork")


def main() -> None:
    argv = sys.argv[1:]
    batches = [parse(arguments) for arguments in json.load(open(argv[1]))] if argv[:1] == ["--batch"] else [parse(argv)]
    import deepspeed  # noqa: F401 - imported once, before the ranks are forked
    import transformers  # noqa: F401

    for args in batches:
        write(args)


if __name__ == "__main__":
    main()
