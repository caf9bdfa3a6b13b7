"""rayexport against DeepSpeed's own `zero_to_fp32.py` on a DeepSpeed ZeRO-3 checkpoint.

    python benchmarks/deepspeed_bench.py                      # 2.4 GB of fp32 weights, world size 4
    python benchmarks/deepspeed_bench.py --size 1GB --verify none,full --workers 2
    python benchmarks/deepspeed_bench.py --size 12GB --verify full --cap 6GiB    # the converter in a memory cap

The checkpoint is synthetic, in DeepSpeed's own format: a Llama config sized so that its fp32
master weights take `--size`, each of `--world-size` ranks' files holding its ZeRO-3 partition of
every parameter (`fp32_flat_groups`) and Adam's two moments beside it (three times the weights on
disk), with the model states, `latest` and the `zero_to_fp32.py` DeepSpeed writes, and the config
beside `latest` (Trainer's layout). It is written by DeepSpeed's Python (the tests' DeepSpeed
virtualenv, `tests/support/deepspeed_env.py`), whose classes the files pickle; training a model
this size under DeepSpeed does not fit this machine. tests/test_deepspeed.py reads DeepSpeed's own
saves of small models.

On the same files, each run once unmeasured first (both sides warm), then measured:
  1. DeepSpeed's converter, as its users run it: `python <save>/zero_to_fp32.py <save> <out>
     --safe_serialization`, one process (fp32 safetensors, no config, no check);
  2. rayexport through its command line at each `--verify` level, writing fp32 too (`--dtype
     float32`, the same bytes), with its default writers (every worker), joined to a Ray head
     started once (its start on its own line); with `--own-ray` also starting its own Ray, and
     with `--before TREE` also from another checkout (the before of a change), in the same invocation.
Wall time and the largest process's peak memory, side by side. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support: the tests' model configs and virtualenvs



def write_checkpoint(save: str, world: int) -> None:
    """The synthetic ZeRO-3 checkpoint of the model whose config.json is in `save` (run with
    DeepSpeed's Python)."""
    from collections import OrderedDict

    import deepspeed
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(save))
    shapes = OrderedDict((name, param.shape) for name, param in model.named_parameters())
    tag = os.path.join(save, "global_step1")
    os.makedirs(tag)
    generator = torch.Generator().manual_seed(0)
    for rank in range(world):
        chunks = []
        for shape in shapes.values():
            numel = math.prod(shape)
            partition = math.ceil(numel / world)
            length = max(0, min(partition, numel - rank * partition))
            chunk = torch.zeros(partition)
            chunk[:length] = torch.randn(length, generator=generator) * 0.02
            chunks.append(chunk)
        flat = torch.cat(chunks)
        optimizer = {
            "zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False,
            "overflow": False, "partition_count": world, "fp32_flat_groups": [flat],
            "optimizer_state_dict": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": flat * 0.1,
                                                   "exp_avg_sq": flat * flat}},
                                     "param_groups": [{"lr": 1e-5, "params": [0]}]},
        }
        torch.save({"optimizer_state_dict": optimizer, "ds_config": {}, "ds_version": deepspeed.__version__},
                   os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        del flat, optimizer, chunks
        model = {
            "module": OrderedDict((name, torch.empty(0)) for name in shapes), "buffer_names": [],
            "param_shapes": [shapes], "frozen_param_shapes": OrderedDict(), "shared_params": {},
            "frozen_param_fragments": {}, "dp_world_size": world, "mp_world_size": 1, "ds_config": {},
            "ds_version": deepspeed.__version__,
        }
        torch.save(model, os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    shutil.copy(os.path.join(os.path.dirname(deepspeed.__file__), "utils", "zero_to_fp32.py"), save)
    with open(os.path.join(save, "latest"), "w") as handle:  # last, as DeepSpeed writes it
        handle.write("global_step1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2.4GB", help="fp32 weights (default 2.4GB; three times that on disk)")
    parser.add_argument("--world-size", type=int, default=4, help="ranks the checkpoint is partitioned over (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="rayexport workers (default 2)")
    parser.add_argument("--bucket-size", default="256MiB", help="rayexport --bucket-size (default 256MiB)")
    parser.add_argument("--verify", default="none,full", help="rayexport --verify levels (default none,full)")
    parser.add_argument("--cap", metavar="SIZE",
                        help="run zero_to_fp32.py inside a cgroup-v1 memory cap of SIZE (for a checkpoint larger than memory)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rayexport-deepspeed-bench"))
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    parser.add_argument("--before", metavar="TREE", help="also run every rayexport row from this checkout")
    parser.add_argument("--own-ray", action="store_true", help="also run every rayexport row starting its own Ray")
    parser.add_argument("--write-checkpoint", nargs=2, metavar=("SAVE", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_checkpoint:  # in DeepSpeed's Python
        write_checkpoint(args.write_checkpoint[0], int(args.write_checkpoint[1]))
        return 0

    from export_bench import against_rayexport, measure, parse_size, print_against
    from support.deepspeed_env import deepspeed_python
    from support.models import sized_llama_config
    from support.virtualenvs import DEEPSPEED_CACHE

    deepspeed = deepspeed_python(DEEPSPEED_CACHE)
    levels = [level.strip() for level in args.verify.split(",") if level.strip()]
    save = os.path.join(args.workdir, f"checkpoint-{args.size}-w{args.world_size}")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    if not os.path.exists(os.path.join(save, "latest")):
        shutil.rmtree(save, ignore_errors=True)
        print(f"writing a ZeRO-3 checkpoint of {args.size} fp32 weights over {args.world_size} ranks to {save}", flush=True)
        sized_llama_config(parse_size(args.size), hidden_size=1024, dtype="float32").save_pretrained(save)
        measure([deepspeed, os.path.abspath(__file__), "--write-checkpoint", save, str(args.world_size)], env)
    tag = os.path.join(save, "global_step1")
    nbytes = sum(os.path.getsize(os.path.join(tag, name)) for name in os.listdir(tag))
    out, report_path = os.path.join(args.workdir, "out"), os.path.join(args.workdir, "report.json")

    converter = [deepspeed, os.path.join(save, "zero_to_fp32.py"), save, out, "--safe_serialization"]
    ray_start_s, rows = against_rayexport(("DeepSpeed's zero_to_fp32.py (one process)", converter, env), save, out, levels,
                                          args.workers, args.bucket_size, report_path, ("--dtype", "float32"),
                                          parse_size(args.cap) if args.cap else None, args.before, args.own_ray)
    print(f"\n{nbytes / 1e9:.2f} GB on disk ({args.size} of fp32 weights, Adam's moments beside), ZeRO-3 over "
          f"{args.world_size} ranks; rayexport {args.workers} workers, joined to a Ray head (its start: {ray_start_s:.1f} s)\n")
    print_against(rows, "x zero_to_fp32")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"nbytes": nbytes, "ray_start_s": ray_start_s, "runs": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
