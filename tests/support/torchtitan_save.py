"""Writes a real torchtitan checkpoint of a tiny model, and torchtitan's own conversion of it.

Run with a Python that `torchtitan_env.torchtitan_python` made (torchtitan 0.3.0 or 0.2.2 on
CPU), not the project's:

    python torchtitan_save.py --out DIR --model llama3|qwen3|qwen3_moe --tied|--untied
        --save final|periodic [--dtype float32|bfloat16] [--steps N]
    python torchtitan_save.py --out DIR --model llama3 --flavor 1B --save final [--steps 0]

Everything that decides what lands on disk is torchtitan's own code, driven as its Trainer
drives it: its model classes and configs, its `parallelize_fn` (FSDP2 over 2 gloo ranks), its
optimizer, LR scheduler and dataloader containers, `--steps N` training steps (default 2; 0
saves the initialised weights untrained), and its `CheckpointManager` writing
`DIR/checkpoint/step-N/`. The Trainer itself needs CUDA, so this script does its few
steps. `--save periodic` is an interval save (model, optimizer, lr_scheduler, dataloader,
train_state) in the training dtype `--dtype`; `--save final` is the last step's model-only save,
cast to `--dtype` (torchtitan's `export_dtype`). `--flavor NAME` (torchtitan 0.3) builds one of
its registered Llama 3 flavors instead of the tiny model, tied as the flavor is.

It also writes what an export must reproduce, from the weights as saved:
- `DIR/reference/to_hf.safetensors`: torchtitan's `StateDictAdapter.to_hf` of the full state;
- `DIR/reference/logits.safetensors`: torchtitan's model's logits (`logits`, float32) on
  `PROMPT_IDS`, in float32. Hugging Face's model of to_hf's output reproduces them to float32
  rounding, except for MoE: torchtitan computes its experts in bfloat16, and routes with its
  load-balancing `expert_bias_E`, which to_hf drops (a routing flip changes logits visibly);
- `DIR/hf/config.json`: the Hugging Face config of the same model (no weights).
With `--flavor` only the config is written: the references hold the whole model on each rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]  # tests/support/models.py's prompt
WORLD_SIZE = 2
STEPS = 2  # the default of --steps
SEQ_LEN = 16
BATCH = 2
SEED = 1234


@dataclasses.dataclass(frozen=True)
class Shape:
    """The tiny model's sizes (GQA; Qwen3's head_dim differs from dim / heads)."""

    vocab: int = 320
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    qwen3_head_dim: int = 32
    hidden: int = 96
    experts: int = 4
    top_k: int = 2
    rope_theta: float = 500000.0
    max_seq_len: int = 131072
    # Llama 3's RoPE scaling, with a short original context so that it moves most frequencies.
    rope_factor: float = 4.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 64


def flavor_shape(flavor: str) -> Shape:
    """The sizes of torchtitan's registered Llama 3 `flavor`, read from its own config."""
    from torchtitan.models import llama3

    config = llama3.model_registry(flavor).model
    attention = config.layers[0].attention
    rope = attention.rope
    return Shape(
        vocab=config.vocab_size, dim=config.dim, layers=len(config.layers), heads=attention.n_heads,
        kv_heads=attention.n_kv_heads or attention.n_heads, head_dim=rope.dim,
        hidden=config.layers[0].feed_forward.w1.out_features, rope_theta=float(rope.theta),
        max_seq_len=rope.max_seq_len, rope_factor=rope.scaling_factor, rope_low_freq_factor=rope.low_freq_factor,
        rope_high_freq_factor=rope.high_freq_factor, rope_original_max_len=rope.original_max_position_embeddings,
    )


def flavor_tied(flavor: str) -> bool:
    """Whether torchtitan's Llama 3 `flavor` ties its output head to the embedding."""
    from torchtitan.models import llama3

    return llama3.model_registry(flavor).model.enable_weight_tying


def hf_config(name: str, shape: Shape, tied: bool) -> dict:
    """The Hugging Face config.json of the same model: every field its forward depends on, in the
    spelling (`rope_theta`, `rope_scaling`) that transformers 4.50+ and 5 all read."""
    head_dim = shape.head_dim if name == "llama3" else shape.qwen3_head_dim
    config = dict(
        vocab_size=shape.vocab, hidden_size=shape.dim, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=head_dim,
        intermediate_size=shape.hidden, max_position_embeddings=shape.max_seq_len, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=tied, rope_theta=shape.rope_theta, torch_dtype="float32",
    )
    if name == "llama3":
        return dict(
            config, model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, mlp_bias=False,
            rope_scaling=dict(
                rope_type="llama3", factor=shape.rope_factor, low_freq_factor=shape.rope_low_freq_factor,
                high_freq_factor=shape.rope_high_freq_factor,
                original_max_position_embeddings=shape.rope_original_max_len,
            ),
        )
    qwen3 = dict(config, rms_norm_eps=1e-6, use_sliding_window=False)
    if name == "qwen3":
        return dict(qwen3, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    return dict(
        qwen3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=shape.hidden,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[],
    )


class Titan03:
    """torchtitan 0.3: a `ModelSpec` holding a config from the family's own layer builders
    (fused QKV, as its flavors) or a registered flavor's, and `Configurable` components."""

    def __init__(self, args: argparse.Namespace, shape: Shape):
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.activation_checkpoint import SelectiveAC
        from torchtitan.models.common.attention import ScaledDotProductAttention

        self.args, self.final = args, args.save == "final"
        self.spec, set_sharding = self._flavor(args.flavor) if args.flavor else self._family(args.model, shape, args.tied)
        # Causal SDPA, swapped in as torchtitan's own graph_trainer tests do: its flex attention
        # has no backward on CPU. On one unpadded document both compute the same.
        for layer in self.spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        set_sharding(self.spec.model)
        # torch 2.13's fully_shard cannot read the default "spmd_types" annotations.
        self.parallelism = ParallelismConfig(data_parallel_shard_degree=WORLD_SIZE, spmd_backend="partial_dtensor")
        dist_utils.set_spmd_backend(self.parallelism.spmd_backend)
        self.training = TrainingConfig(steps=args.steps, seq_len=SEQ_LEN, local_batch_size=BATCH,
                                       dtype="float32" if self.final else args.dtype)
        self.parallelize_kwargs = dict(
            training=self.training, parallelism=self.parallelism, compile_config=CompileConfig(),
            ac_config=SelectiveAC.Config(), dump_folder=args.out,
        )

    @staticmethod
    def _flavor(flavor: str):
        """The ModelSpec of a registered Llama 3 flavor, and its sharding setter."""
        from torchtitan.models import llama3
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        return llama3.model_registry(flavor), lambda c: set_llama3_sharding_config(c, enable_sp=False)

    @staticmethod
    def _family(name: str, shape: Shape, tied: bool):
        """A ModelSpec of the family `name` holding the tiny model's config, and its sharding setter."""
        from torchtitan.models import llama3, qwen3
        from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        family = llama3 if name == "llama3" else qwen3
        model_config = dict(
            dim=shape.dim, vocab_size=shape.vocab, enable_weight_tying=tied,
            tok_embeddings=Embedding.Config(
                num_embeddings=shape.vocab, embedding_dim=shape.dim,
                param_init=family._EMBEDDING_SKIP_INIT if tied else family._EMBEDDING_INIT,
            ),
        )
        common = dict(n_layers=shape.layers, dim=shape.dim, n_heads=shape.heads, n_kv_heads=shape.kv_heads,
                      attn_backend="flex")
        if name == "llama3":
            rope = ComplexRoPE.Config(
                dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta, scaling="llama",
                scaling_factor=shape.rope_factor, low_freq_factor=shape.rope_low_freq_factor,
                high_freq_factor=shape.rope_high_freq_factor,
                original_max_position_embeddings=shape.rope_original_max_len,
            )
            config = llama3.Llama3Model.Config(
                **model_config,
                norm=RMSNorm.Config(normalized_shape=shape.dim, param_init=llama3._NORM_INIT),
                lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab,
                                      param_init=llama3._output_linear_init(shape.dim)),
                layers=llama3._build_llama3_layers(**common, hidden_dim=shape.hidden, rope=rope),
            )
            spec = dataclasses.replace(llama3.model_registry("debugmodel"), model=config)
            return spec, lambda c: set_llama3_sharding_config(c, enable_sp=False)
        common.update(head_dim=shape.qwen3_head_dim,
                      rope=CosSinRoPE.Config(dim=shape.qwen3_head_dim, max_seq_len=shape.max_seq_len,
                                             theta=shape.rope_theta))
        if name == "qwen3_moe":
            layers = qwen3._build_qwen3_moe_layers(
                **common, moe_hidden_dim=shape.hidden, num_experts=shape.experts, top_k=shape.top_k,
                moe_comm_backend="standard",
            )
        else:
            layers = qwen3._build_qwen3_layers(**common, hidden_dim=shape.hidden)
        config = qwen3.Qwen3Model.Config(
            **model_config, norm=qwen3._qwen3_norm(shape.dim), layers=layers,
            lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab, param_init=qwen3._LINEAR_INIT),
        )
        spec = dataclasses.replace(qwen3.model_registry("debugmodel"), model=config)
        return spec, lambda c: set_qwen3_sharding_config(c, enable_sp=False, enable_ep=False)

    def parallel_dims(self):
        from torchtitan.distributed import ParallelDims

        return ParallelDims.from_config(self.parallelism, WORLD_SIZE)

    def build(self) -> torch.nn.Module:
        return self.spec.model.build()

    def parallelize(self, model: torch.nn.Module, parallel_dims) -> torch.nn.Module:
        return self.spec.parallelize_fn(model, parallel_dims=parallel_dims, **self.parallelize_kwargs)

    def components(self, model: torch.nn.Module, parallel_dims, dataloader, train_state):
        """Its optimizer, LR scheduler and CheckpointManager, built as its Trainer builds them."""
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

        optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
        if self.spec.post_optimizer_build_fn is not None:
            self.spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)
        lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
            optimizers=optimizers, training_steps=max(self.args.steps, 1))
        checkpointer = CheckpointManager.Config(
            enable=True, interval=max(self.args.steps, 1), export_dtype=self.args.dtype if self.final else "float32",
        ).build(
            dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=self.adapter(), base_folder=self.args.out,
        )
        return optimizers, lr_schedulers, checkpointer

    def adapter(self):
        return self.spec.state_dict_adapter(self.spec.model, None)

    @staticmethod
    def forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Logits, given the positions its Trainer passes (the SDPA backend takes no masks)."""
        return model(tokens, torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1))


class Titan02:
    """torchtitan 0.2: a `TrainSpec` with its ModelArgs dataclasses, and a `JobConfig`."""

    # What it cannot write on CPU with torch 2.13, and why.
    UNSUPPORTED = (
        "torchtitan 0.2 writes neither tied models (its Llama 3 has no tying; torch 2.13's FSDP2 rejects "
        "its Qwen3's tied weights in two FSDP groups) nor MoE ones (its router's histc has no CPU kernel "
        "for integers)"
    )

    def __init__(self, args: argparse.Namespace, shape: Shape):
        from torchtitan.config import JobConfig
        from torchtitan.protocols.train_spec import get_train_spec

        self.args, final = args, args.save == "final"
        self.spec = get_train_spec("llama3" if args.model == "llama3" else "qwen3")
        self.model_args = self._model_args(args.model, shape, args.tied)
        job = self.job = JobConfig()
        job.job.dump_folder = args.out
        job.training.steps, job.training.seq_len, job.training.local_batch_size = args.steps, SEQ_LEN, BATCH
        job.training.dtype = "float32" if final else args.dtype
        job.parallelism.data_parallel_shard_degree = WORLD_SIZE
        job.lr_scheduler.warmup_steps = 1
        job.checkpoint.enable, job.checkpoint.interval = True, max(args.steps, 1)
        job.checkpoint.export_dtype = args.dtype if final else "float32"
        self.model_args.update_from_config(job)

    @staticmethod
    def _model_args(name: str, shape: Shape, tied: bool):
        if name == "llama3":
            from torchtitan.models.llama3 import TransformerModelArgs
            from torchtitan.models.llama3.model.args import RoPEScalingArgs

            # Its hidden size: 2/3 of 4 * dim, times ffn_dim_multiplier, rounded up to multiple_of.
            return TransformerModelArgs(
                dim=shape.dim, n_layers=shape.layers, n_heads=shape.heads, n_kv_heads=shape.kv_heads,
                vocab_size=shape.vocab, multiple_of=32, ffn_dim_multiplier=shape.hidden / int(8 * shape.dim / 3),
                rope_theta=shape.rope_theta, max_seq_len=shape.max_seq_len,
                rope_scaling_args=RoPEScalingArgs(
                    scaling_factor=shape.rope_factor, low_freq_factor=shape.rope_low_freq_factor,
                    high_freq_factor=shape.rope_high_freq_factor,
                    original_max_position_embeddings=shape.rope_original_max_len,
                ),
            )
        from torchtitan.models.moe import MoEArgs
        from torchtitan.models.qwen3 import Qwen3ModelArgs

        moe = name == "qwen3_moe"
        return Qwen3ModelArgs(
            dim=shape.dim, n_layers=shape.layers, n_heads=shape.heads, n_kv_heads=shape.kv_heads,
            vocab_size=shape.vocab, head_dim=shape.qwen3_head_dim, hidden_dim=shape.hidden,
            rope_theta=shape.rope_theta, max_seq_len=shape.max_seq_len, enable_weight_tying=tied,
            moe_enabled=moe, moe_inter_dim=shape.hidden,
            # As its Qwen3 MoE flavors set them.
            moe_args=MoEArgs(num_experts=shape.experts, num_shared_experts=0, top_k=shape.top_k,
                             score_func="softmax", route_norm=True, route_scale=1.0, score_before_experts=False),
        )

    def parallel_dims(self):
        from torchtitan.distributed import ParallelDims

        return ParallelDims(dp_shard=WORLD_SIZE, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=WORLD_SIZE)

    def build(self) -> torch.nn.Module:
        return self.spec.model_cls(self.model_args)

    def parallelize(self, model: torch.nn.Module, parallel_dims) -> torch.nn.Module:
        return self.spec.parallelize_fn(model, parallel_dims, self.job)

    def components(self, model: torch.nn.Module, parallel_dims, dataloader, train_state):
        """Its optimizer, LR scheduler and CheckpointManager, built as its Trainer builds them."""
        from torchtitan.components.checkpoint import CheckpointManager

        optimizers = self.spec.build_optimizers_fn([model], self.job.optimizer, parallel_dims)
        lr_schedulers = self.spec.build_lr_schedulers_fn(optimizers, self.job.lr_scheduler, max(self.args.steps, 1))
        checkpointer = CheckpointManager(
            dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, checkpoint_config=self.job.checkpoint, sd_adapter=self.adapter(),
            base_folder=self.args.out,
        )
        return optimizers, lr_schedulers, checkpointer

    def adapter(self):
        return self.spec.state_dict_adapter(self.model_args, None)

    @staticmethod
    def forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)


class TokenWindows(torch.utils.data.IterableDataset):
    """Random token windows in the form torchtitan's text datasets yield them, resumable as they
    are: `({"input": ids, "positions": positions}, labels)` with a `state_dict`."""

    def __init__(self, vocab: int, rank: int):
        self.vocab, self.rank, self.sample_idx = vocab, rank, 0

    def __iter__(self):
        while True:
            generator = torch.Generator().manual_seed(SEED + 1000 * self.rank + self.sample_idx)
            tokens = torch.randint(self.vocab, (SEQ_LEN + 1,), generator=generator)
            self.sample_idx += 1
            yield {"input": tokens[:-1], "positions": torch.arange(SEQ_LEN)}, tokens[1:]

    def state_dict(self) -> dict:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict) -> None:
        self.sample_idx = state["sample_idx"]


class TrainState:
    """The Trainer's own checkpointed state (`Trainer.state_dict`): step and tokens seen."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def installed_torchtitan():
    """The driver class for the torchtitan this Python has."""
    return Titan02 if importlib.metadata.version("torchtitan").startswith("0.2.") else Titan03


def materialize(model: torch.nn.Module) -> None:
    """Allocate a meta-built model on CPU and initialize it, as torchtitan's Trainer does."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)


def run_rank(rank: int, args: argparse.Namespace, rendezvous: str) -> None:
    """One gloo rank: build, shard, train `--steps` steps and save as torchtitan's Trainer does.
    The ranks meet through the file `rendezvous` (no port is picked in advance)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_SIZE)
    # DTensor's RNG is CUDA-only: on CPU each rank draws its own shards, so seed the ranks apart.
    torch.manual_seed(SEED + rank)
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.utils import set_default_dtype

    # Its mesh builder takes the accelerator's device type; these ranks run on CPU.
    parallel_dims_module.device_type = "cpu"
    shape = flavor_shape(args.flavor) if args.flavor else Shape()
    titan = installed_torchtitan()(args, shape)
    parallel_dims = titan.parallel_dims()
    parallel_dims.build_mesh()
    training_dtype = TORCH_DTYPE_MAP["float32" if args.save == "final" else args.dtype]
    with torch.device("meta"), set_default_dtype(training_dtype):
        model = titan.build()
    model = titan.parallelize(model, parallel_dims)
    for module in model.modules():
        # gloo has no PREMUL_SUM, the reduction FSDP2 picks for torchtitan's divide factor of 1.
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    materialize(model)
    model.train()

    dataloader = ParallelAwareDataloader(TokenWindows(shape.vocab, rank), dp_rank=rank, dp_world_size=WORLD_SIZE,
                                         batch_size=BATCH)
    train_state = TrainState()
    optimizers, lr_schedulers, checkpointer = titan.components(model, parallel_dims, dataloader, train_state)
    batches = iter(dataloader)
    final = args.save == "final"
    for step in range(1, args.steps + 1):
        optimizers.zero_grad()
        inputs, labels = next(batches)
        logits = titan.forward(model, inputs["input"])
        # torchtitan's loss: the sum over this rank's tokens divided by the global token count.
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        (loss / (labels.numel() * WORLD_SIZE)).backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        train_state.step, train_state.ntokens_seen = step, train_state.ntokens_seen + labels.numel()
        checkpointer.save(step, last_step=final and step == args.steps)
    if args.steps == 0:
        checkpointer.save(0, last_step=final)
    checkpointer.close()

    if not args.flavor:
        saved_dtype = TORCH_DTYPE_MAP[args.dtype]
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        if rank == 0:
            write_reference(args, titan, {k: v.to(saved_dtype) if v.is_floating_point() else v for k, v in state.items()})
    if rank == 0:
        write_hf_config(args, shape)
    dist.barrier()
    dist.destroy_process_group()


def write_reference(args: argparse.Namespace, titan, state: dict[str, torch.Tensor]) -> None:
    """torchtitan's HF conversion of the saved weights and its model's logits on them."""
    reference = os.path.join(args.out, "reference")
    os.makedirs(reference, exist_ok=True)
    hf_state = titan.adapter().to_hf(dict(state))
    save_file({k: v.contiguous() for k, v in hf_state.items()}, os.path.join(reference, "to_hf.safetensors"))

    with torch.device("meta"):
        model = titan.build()
    materialize(model)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.eval()
    with torch.no_grad():
        logits = titan.forward(model, torch.tensor(PROMPT_IDS)).float()
    save_file({"logits": logits.contiguous()}, os.path.join(reference, "logits.safetensors"))


def write_hf_config(args: argparse.Namespace, shape: Shape) -> None:
    """`DIR/hf/config.json`: the Hugging Face config of the model written."""
    os.makedirs(os.path.join(args.out, "hf"), exist_ok=True)
    with open(os.path.join(args.out, "hf", "config.json"), "w") as f:
        json.dump(hf_config(args.model, shape, args.tied), f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=["llama3", "qwen3", "qwen3_moe"], required=True)
    tying = parser.add_mutually_exclusive_group()
    tying.add_argument("--tied", dest="tied", action="store_true", default=None)
    tying.add_argument("--untied", dest="tied", action="store_false")
    parser.add_argument("--flavor", help="a registered torchtitan 0.3 Llama 3 flavor (1B, 8B...) instead of the tiny model")
    parser.add_argument("--save", choices=["final", "periodic"], required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps before the save (0: none)")
    args = parser.parse_args()
    if args.flavor:
        if args.model != "llama3" or installed_torchtitan() is Titan02 or args.tied is not None:
            parser.error("--flavor takes --model llama3, torchtitan 0.3, and no --tied/--untied (the flavor decides)")
        args.tied = flavor_tied(args.flavor)
    elif args.tied is None:
        parser.error("one of --tied, --untied is required")
    if installed_torchtitan() is Titan02 and (args.tied or args.model == "qwen3_moe"):
        parser.error(Titan02.UNSUPPORTED)
    with tempfile.TemporaryDirectory(prefix="torchtitan-ranks-") as scratch:
        mp.spawn(run_rank, args=(args, os.path.join(scratch, "rendezvous")), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
