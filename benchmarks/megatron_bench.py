"""rayexport against the single-process way on a Megatron-Core torch_dist checkpoint.

    python benchmarks/megatron_bench.py                       # about 2.4 GB, world size 4
    python benchmarks/megatron_bench.py --size 1GB --verify none,full --workers 2

The checkpoint is synthetic: a Llama config sized to the target (bf16), its weights under
Megatron-Core's names and stacked shapes (layers on a leading axis, q/k/v rows a query group at
a time, [gate ; up]), saved with `torch.distributed.checkpoint` by `--world-size` gloo ranks, each
holding its tensor-parallel slice of the rows of every stacked tensor, as Megatron's TP ranks
do, with the `metadata.json` Megatron writes, in verl's layout (`actor/dist_ckpt/`,
`actor/huggingface/config.json`). Megatron-Core's own save of a model this size does not fit
this machine (its training state is 16 bytes a parameter); tests/test_megatron.py reads its own
saves of small models.

On the same files, each run once unmeasured first (both sides warm), then measured:
  1. the single-process way: torch's `dcp_to_torch_save` of the whole checkpoint into one
     `.pt`, then, in the same process, the conversion to Hugging Face names (each layer's q, k
     and v from its query groups, gate and up from `linear_fc1`'s halves) and safetensors'
     `save_file`, as a user without a converter writes it;
  2. rayexport through its command line at each `--verify` level, with its default writers (every
     worker), joined to a Ray head started once (its start is reported on its own line, as `ray
     job submit` runs on a cluster that is up); with `--own-ray` also starting its own Ray, and
     with `--before TREE` also from another checkout (the before of a change), in the same invocation.
Wall time and the largest process's peak memory, side by side. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support: the tests' model configs

from export_bench import against_rayexport, parse_size, print_against  # noqa: E402
from support.models import sized_llama_config  # noqa: E402

TORCH_DIST = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}


def megatron_shapes(config) -> dict[str, tuple[int, ...]]:
    """Each Megatron-Core tensor of the config's Llama model, with its global shape."""
    layers, hidden, ffn = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    qkv_rows = (heads + 2 * groups) * head_dim
    return {
        "embedding.word_embeddings.weight": (config.vocab_size, hidden),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (layers, hidden),
        "decoder.layers.self_attention.linear_qkv.weight": (layers, qkv_rows, hidden),
        "decoder.layers.self_attention.linear_proj.weight": (layers, hidden, heads * head_dim),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (layers, hidden),
        "decoder.layers.mlp.linear_fc1.weight": (layers, 2 * ffn, hidden),
        "decoder.layers.mlp.linear_fc2.weight": (layers, hidden, ffn),
        "decoder.final_layernorm.weight": (hidden,),
        "output_layer.weight": (config.vocab_size, hidden),
    }


def _save_rank(rank: int, world_size: int, shapes: dict, folder: str, rendezvous: str) -> None:
    """One gloo rank's save: its slice of every tensor (`_split_axis`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(rank)
    state = {}
    for name, shape in shapes.items():
        axis = _split_axis(shape)
        local = list(shape)
        local[axis] = shape[axis] // world_size
        values = torch.randn(local, generator=generator, dtype=torch.float32).to(torch.bfloat16)
        state[name] = DTensor.from_local(values, mesh, [Shard(axis)], run_check=False)
    dcp.save(state, checkpoint_id=folder)
    dist.destroy_process_group()


def _split_axis(shape: tuple[int, ...]) -> int:
    """The axis the ranks split: a stacked matrix's rows, a stacked norm's (or a 2-D tensor's)
    columns, since the number of layers need not divide by the world size."""
    return 1 if len(shape) == 3 else len(shape) - 1


def write_checkpoint(config, actor: str, world_size: int) -> int:
    """The synthetic checkpoint under `actor` (verl's layout); its bytes."""
    import torch.multiprocessing as mp

    folder = os.path.join(actor, "dist_ckpt")
    os.makedirs(folder)
    shapes = megatron_shapes(config)
    for shape in shapes.values():
        assert shape[_split_axis(shape)] % world_size == 0, shape
    rendezvous = os.path.join(actor, ".rendezvous")
    mp.spawn(_save_rank, args=(world_size, shapes, folder, rendezvous), nprocs=world_size, join=True)
    if os.path.exists(rendezvous):  # gloo removes its file once every rank has joined
        os.remove(rendezvous)
    with open(os.path.join(folder, "metadata.json"), "w") as handle:
        json.dump(TORCH_DIST, handle)
    config.save_pretrained(os.path.join(actor, "huggingface"))
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))


def single_process(actor: str, out: str) -> None:
    """The way without a converter: the whole checkpoint into one file, then converted."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.join(actor, "huggingface"))
    os.makedirs(out)
    whole = os.path.join(out, "whole.pt")
    dcp_to_torch_save(os.path.join(actor, "dist_ckpt"), whole)
    saved = torch.load(whole, mmap=True, weights_only=True)
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    head_dim, per_group = config.hidden_size // heads, heads // groups
    ffn = config.intermediate_size
    hf = {
        "model.embed_tokens.weight": saved["embedding.word_embeddings.weight"],
        "lm_head.weight": saved["output_layer.weight"],
        "model.norm.weight": saved["decoder.final_layernorm.weight"],
    }
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        qkv = saved["decoder.layers.self_attention.linear_qkv.weight"][layer].view(groups, per_group + 2, head_dim, -1)
        hf[prefix + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(heads * head_dim, -1).contiguous()
        hf[prefix + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(groups * head_dim, -1).contiguous()
        hf[prefix + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(groups * head_dim, -1).contiguous()
        hf[prefix + "self_attn.o_proj.weight"] = saved["decoder.layers.self_attention.linear_proj.weight"][layer]
        hf[prefix + "input_layernorm.weight"] = saved["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][layer]
        hf[prefix + "post_attention_layernorm.weight"] = saved["decoder.layers.mlp.linear_fc1.layer_norm_weight"][layer]
        fc1 = saved["decoder.layers.mlp.linear_fc1.weight"][layer]
        hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"] = fc1[:ffn], fc1[ffn:]
        hf[prefix + "mlp.down_proj.weight"] = saved["decoder.layers.mlp.linear_fc2.weight"][layer]
    save_file({name: tensor.contiguous() for name, tensor in hf.items()}, os.path.join(out, "model.safetensors"))
    del saved, hf
    os.remove(whole)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2.4GB", help="checkpoint size (default 2.4GB)")
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks that save it (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="rayexport workers (default 2)")
    parser.add_argument("--bucket-size", default="256MiB", help="rayexport --bucket-size (default 256MiB)")
    parser.add_argument("--verify", default="none,full", help="rayexport --verify levels (default none,full)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rayexport-megatron-bench"))
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    parser.add_argument("--before", metavar="TREE", help="also run every rayexport row from this checkout")
    parser.add_argument("--own-ray", action="store_true", help="also run every rayexport row starting its own Ray")
    parser.add_argument("--single-process", nargs=2, metavar=("ACTOR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.single_process:  # the baseline, in a process of its own so that its peak is its own
        single_process(*args.single_process)
        return 0
    levels = [level.strip() for level in args.verify.split(",") if level.strip()]
    config = sized_llama_config(parse_size(args.size), hidden_size=1024)
    actor = os.path.join(args.workdir, f"ckpt-{args.size}", "global_step_1", "actor")
    if not os.path.exists(os.path.join(actor, "dist_ckpt", "metadata.json")):
        shutil.rmtree(os.path.dirname(os.path.dirname(actor)), ignore_errors=True)
        print(f"writing a {args.size} Megatron-named checkpoint ({config.num_hidden_layers} layers) to {actor}", flush=True)
        write_checkpoint(config, actor, args.world_size)
    folder = os.path.join(actor, "dist_ckpt")
    nbytes = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
    out, report_path = os.path.join(args.workdir, "out"), os.path.join(args.workdir, "report.json")

    baseline = ("dcp_to_torch_save, then convert (one process)",
                [sys.executable, os.path.abspath(__file__), "--single-process", actor, out], None)
    ray_start_s, rows = against_rayexport(baseline, actor, out, levels, args.workers, args.bucket_size, report_path,
                                          before=args.before, own_ray=args.own_ray)
    print(f"\n{nbytes / 1e9:.2f} GB, {config.num_hidden_layers} layers, world size {args.world_size}; "
          f"rayexport {args.workers} workers, joined to a Ray head (its start: {ray_start_s:.1f} s)\n")
    print_against(rows, "x one process")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"nbytes": nbytes, "layers": config.num_hidden_layers, "ray_start_s": ray_start_s, "runs": rows},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
