"""Writes a real Megatron-Core `torch_dist` checkpoint of a tiny model, and mbridge's own
Hugging Face export of it.

Run with a Python that `megatron_env.megatron_python` made (Megatron-Core 0.16.1, mbridge 0.15.1,
on CPU), not the project's:

    python megatron_save.py --out DIR --model llama|qwen2|qwen3|qwen3_moe|mixtral|deepseek_v3|qwen2_moe|glm4_moe
        [--tp N] [--pp N] [--ep N] --tied|--untied [--dtype float32|bfloat16]
        [--experts sequential|grouped] [--layout verl|megatron-lm]
        [--optimizer [dp_reshardable|fully_reshardable]] [--steps N] [--names local|te]
    python megatron_save.py --batch FILE   # FILE: a JSON list of such argument lists

It runs tp * pp * ep gloo ranks (at most 4): Megatron draws expert parallelism from data
parallelism, so `--ep N` also makes N data-parallel replicas of the dense weights. `--pp` divides
the 4 layers. MoE models take `--tp 1` (Megatron's MoE layer trains with TP only under sequence
parallelism, which the local spec's torch norm refuses), and `--experts grouped` (the legacy
GroupedMLP) takes bfloat16, the only dtype it computes in.

Everything that decides what lands on disk is Megatron-Core's own code, driven as verl drives it
through mbridge: mbridge's `AutoBridge.from_config` turns the Hugging Face config into Megatron's
`TransformerConfig` (the flags verl trains with, less the CPU-only changes of `cpu_overrides`),
`parallel_state.initialize_model_parallel` on gloo, mbridge's model provider building `GPTModel`
with `get_gpt_layer_local_spec` in place of the TransformerEngine spec (no TE on CPU), Megatron's
`DistributedDataParallel` (inside `Float16Module` in bfloat16), its optimizer
(`get_megatron_optimizer`, Adam; with `--optimizer` the distributed optimizer, its state saved in
the given format) and `OptimizerParamScheduler`, `--steps N` training steps (default 2) through its
pipeline schedule (`get_forward_backward_func`, `finalize_model_grads`), and
`dist_checkpointing.save` of the model's `sharded_state_dict()` with the torch_dist strategy, fully
parallel over data-parallel ranks, as verl and Megatron-LM save; with `--names te` under the keys
Megatron-Core's TransformerEngine spec saves the same tensors with, as every GPU run does
(`te_spec_keys`). The state dict is the trainer's:

- `--layout verl` (default): `{"model", "rng_state"}` (+ `"optimizer"`, `"lr_scheduler"`) in
  `DIR/actor/dist_ckpt/`, and the Hugging Face config in `DIR/actor/huggingface/config.json`;
- `--layout megatron-lm`: `{"model", "rng_state", "args", "checkpoint_version", "iteration"}`
  (+ `"optimizer"`, `"opt_param_scheduler"`) in `DIR/iter_000000N/` for N steps, with
  `DIR/latest_checkpointed_iteration.txt` and the Hugging Face config in `DIR/hf/config.json`;
  `args` is an `argparse.Namespace` of the model-structure fields Megatron-LM records.
Both pass Megatron-LM 0.16's sharded state dict metadata (see `save`).

Megatron on CPU needs a few stand-ins, in this writer only (`install_cpu_stand_ins` and
`CudaOnCpu`, each commented): the CUDA RNG tracker's `fork`, `torch.cuda.current_device` and
`synchronize`, the small tensors Megatron's optimizer, schedules and checkpoint strategies create
on "cuda", the MoE all-to-all dispatcher's device-to-host stream, `grouped_gemm.ops.gmm` for the
legacy GroupedMLP (a per-expert matmul loop), and `te_general_gemm`, which moe_utils 0.16.1 names
without defining when TransformerEngine is absent. Forward passes get an explicit causal mask
(Megatron's default one is built on CUDA). DeepSeek-V3's multi-latent attention takes three more
(`MLACoreAttention`, `use_current_mla_field_names`, and the MLA module's TransformerEngine test),
and one setting (`mtp_num_layers=None`, in `cpu_overrides`), each where it is made.

It also writes what an export must reproduce, from rank 0:
- `DIR/reference/mbridge.safetensors`: mbridge's `export_weights` of the trained model (it gathers
  across TP, PP and EP ranks itself). mbridge maps the parameter names of Megatron's
  TransformerEngine spec; the local spec's modules hold the same tensors under other names
  (`input_layernorm.weight` for `self_attention.linear_qkv.layer_norm_weight`, in dense layers
  `pre_mlp_layernorm.weight` for `mlp.linear_fc1.layer_norm_weight`, SequentialMLP's
  `local_experts.E.linear_fcN.weight` and the legacy GroupedMLP's `weight1`/`weight2` (all local
  experts in one tensor, transposed) for TEGroupedMLP's `linear_fcN.weightE`). Megatron-Core itself
  declares these the same tensors: the local spec's `sharded_state_dict_keys_map`, and the expert
  modules' sharded state dicts, written to match each other. So mbridge is handed a view of the
  model under the TE spec's names (`TENamedView`) and runs unchanged on it. mbridge 0.15.1 also
  reads `hf_config.rope_theta`, which transformers 5 keeps in `rope_parameters`: the config object
  given to the bridge gets it as an attribute;
- `DIR/reference/logits.safetensors`: Megatron's model's logits (`logits`, float32, full vocab) on
  `PROMPT_IDS`, through the same pipeline schedule (forward only), gathered across TP. They come
  from a float32 model (SequentialMLP experts) built as the trained one and loaded from the saved
  checkpoint with `dist_checkpointing.load`, so that a float32 Hugging Face model of an export
  reproduces them to float32 rounding whatever the training dtype;
- `DIR/reference/keys.json`: every key of the saved `.metadata` with its global shape and dtype
  (or `bytes` for objects) and chunks, the checkpoint's files, and the classes the `.metadata`
  pickle names (`metadata_globals`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import json
import os
import pickle
import random
import tempfile
import types

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]  # tests/support/models.py's prompt
STEPS = 2  # the default of --steps
SEQ_LEN = 16
BATCH = 2
SEED = 1234
LR = 1e-2  # large enough that two Adam steps move every weight, norms and biases included
MAX_RANKS = 4
RANK_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Shape:
    """The tiny model's sizes (GQA, head_dim given explicitly: 32, the smallest vLLM's CPU
    attention runs, so that an export can be served)."""

    vocab: int = 320
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 128
    experts: int = 4
    top_k: int = 2
    moe_ffn: int = 64
    max_positions: int = 2048


HF_NAMES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
}
MOE_MODELS = ("qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe", "glm4_moe")


def hf_config(name: str, shape: Shape, tied: bool, dtype: str) -> dict:
    """The Hugging Face config.json of the same model: every field its forward depends on, with
    `rope_theta` at the top (transformers 4 reads it there, 5 moves it into `rope_parameters`)
    and the dtype under both spellings (`torch_dtype` for 4, `dtype` for 5)."""
    model_type, architecture = HF_NAMES[name]
    config = dict(
        model_type=model_type, architectures=[architecture], vocab_size=shape.vocab, hidden_size=shape.hidden,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, intermediate_size=shape.ffn, max_position_embeddings=shape.max_positions,
        hidden_act="silu", tie_word_embeddings=tied, attention_dropout=0.0, torch_dtype=dtype, dtype=dtype,
    )
    if name == "llama":
        return dict(config, rope_theta=500000.0, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False)
    if name == "mixtral":
        return dict(config, rope_theta=1000000.0, rms_norm_eps=1e-5, intermediate_size=shape.moe_ffn,
                    num_local_experts=shape.experts, num_experts_per_tok=shape.top_k, router_aux_loss_coef=0.0,
                    sliding_window=None)
    if name == "deepseek_v3":
        return deepseek_v3_config(config, shape)
    if name == "glm4_moe":
        return glm4_moe_config(config, shape)
    qwen = dict(config, rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None)
    if name == "qwen2":
        return dict(qwen, attention_bias=True)
    if name == "qwen3":
        return dict(qwen, attention_bias=False)
    moe = dict(moe_intermediate_size=shape.moe_ffn, num_experts=shape.experts, num_experts_per_tok=shape.top_k,
               decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)
    if name == "qwen2_moe":  # q, k and v biases, a shared expert of its own size behind a sigmoid gate
        return dict(qwen, **moe, qkv_bias=True, norm_topk_prob=False, shared_expert_intermediate_size=96)
    return dict(qwen, **moe, attention_bias=False, norm_topk_prob=True)


def deepseek_v3_config(config: dict, shape: Shape) -> dict:
    """DeepSeek-V3's fields on the tiny sizes: multi-latent attention (q and kv compressed, a
    rope part of 16 per head), one dense layer then MoE layers with a shared expert, sigmoid
    routing with a score-correction bias. One expert group (mbridge passes Megatron no group-limited
    routing) and no multi-token prediction layer (transformers' model has none)."""
    fields = dict(config, num_key_value_heads=shape.heads, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
                  moe_intermediate_size=shape.moe_ffn, first_k_dense_replace=1, n_routed_experts=shape.experts,
                  n_shared_experts=1, num_experts_per_tok=shape.top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                  v_head_dim=32, rope_interleave=True, attention_bias=False, num_mtp_layers=0, rope_scaling=None,
                  topk_method="noaux_tc", scoring_func="sigmoid", aux_loss_alpha=0.0)
    return fields


def glm4_moe_config(config: dict, shape: Shape) -> dict:
    """GLM-4.5's fields on the tiny sizes: rotary embedding on half of each head, q and k norms,
    q, k and v biases (mbridge's bridge always gives Megatron them), one dense layer then MoE ones
    with a shared expert, sigmoid routing with a score-correction bias and a routed scaling factor.
    No multi-token prediction layer (transformers' model has none)."""
    return dict(config, rope_theta=10000.0, partial_rotary_factor=0.5, rms_norm_eps=1e-5, attention_bias=True,
                use_qk_norm=True, moe_intermediate_size=shape.moe_ffn, first_k_dense_replace=1,
                n_routed_experts=shape.experts, n_shared_experts=1, num_experts_per_tok=shape.top_k, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0)


def cpu_overrides(args: argparse.Namespace) -> dict:
    """What this writer changes in mbridge's TransformerConfig, and why: none of it changes a
    parameter's name, shape or sharding."""
    overrides = dict(
        use_cpu_initialization=True,  # mbridge leaves weights to be initialised on the GPU
        # mbridge turns sequence parallelism on with TP; the local spec's norm without apex or TE
        # (WrappedTorchNorm, torch's RMSNorm) refuses it. It moves no parameter: the norm weights
        # are replicated across TP ranks either way.
        sequence_parallel=False,
        masked_softmax_fusion=False, persist_layer_norm=False,  # CUDA kernels
        bias_activation_fusion=False, bias_dropout_fusion=False,
        moe_shared_expert_overlap=False,  # CUDA streams
    )
    if args.model in MOE_MODELS:
        overrides["moe_grouped_gemm"] = args.experts == "grouped"
        overrides["moe_router_dtype"] = "fp32"
    if args.model == "mixtral":
        # mbridge's Mixtral routes softmax-then-top-k (moe_router_pre_softmax) without
        # renormalising the k weights; Hugging Face's Mixtral renormalises them, which is
        # Megatron's top-k-then-softmax. This keeps the references reproducible by HF's model.
        overrides["moe_router_pre_softmax"] = False
    if args.model == "qwen2_moe":
        # mbridge 0.15.1's Qwen2-MoE bridge maps the shared expert's gate but leaves Megatron's
        # `moe_shared_expert_gate` off, so that the model it builds has no gate, which every
        # Qwen2-MoE has (transformers' applies sigmoid(gate(x)) to the shared expert's output);
        # verl's users turn it on in the transformer config they override.
        overrides["moe_shared_expert_gate"] = True
    if args.model == "deepseek_v3":
        # mbridge asks for the fused attention backend (TransformerEngine's); the local spec's
        # attention is Megatron's own, unfused, which computes the same softmax(QK^T)V.
        from megatron.core.transformer.enums import AttnBackend

        overrides["attention_backend"] = AttnBackend.local
        # mbridge turns the config's `num_mtp_layers: 0` into mtp_num_layers=0, which Megatron's
        # forward takes for multi-token prediction being on (it tests for None) and, without
        # labels, fails on; None is what Megatron means by no MTP layer, as that config says.
        overrides["mtp_num_layers"] = None
    return overrides


# --- CPU stand-ins ---------------------------------------------------------------------------


def install_cpu_stand_ins() -> None:
    """Replace the few CUDA-only calls on the paths this writer runs; none touches a weight.
    (Tensors Megatron creates on "cuda" are served by `CudaOnCpu`, entered around each rank.)"""
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import (
        experts,
        grouped_gemm_util,
        moe_utils,
        token_dispatcher,
    )

    # The tracker forks CUDA RNG states around dropout (0 here) and GPU initialisation (not used:
    # use_cpu_initialization draws from the CPU generator).
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    # Megatron allocates on `torch.cuda.current_device()` (the router's weight move, pipeline
    # receive buffers, the all-to-all's output, the DDP grad buffers, the dist_checkpointing
    # failure flags): here that device is the CPU. Synchronisation has nothing to wait for.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # The all-to-all dispatcher copies its token counts to the host on a side CUDA stream, the
    # all-to-all split sizes as numpy arrays; on CPU the counts are on the host already, and only
    # that conversion is left to do.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = split_sizes_to_numpy
    # moe_utils 0.16.1 names `te_general_gemm` in the router's gating without defining it when
    # TransformerEngine is absent (its None test then raises NameError).
    moe_utils.te_general_gemm = None
    # The legacy GroupedMLP's grouped GEMM (`grouped_gemm.ops.gmm`, CUDA only): one matmul per
    # expert over its rows, the same product.
    grouped_gemm_util.grouped_gemm = types.SimpleNamespace()
    grouped_gemm_util.ops = types.SimpleNamespace(gmm=grouped_matmul)
    experts.gg = grouped_gemm_util
    # Multi-latent attention takes TransformerEngine to be present once its extension module
    # imports, which it does without TE (with `TELinear` None), and then calls isinstance on None.
    multi_latent_attention.HAVE_TE = False


def split_sizes_to_numpy(dispatcher, point: str, tokens_per_expert=None):
    """The all-to-all dispatcher's `_maybe_dtoh_and_synchronize` on CPU."""
    if not dispatcher.drop_and_pad and point == dispatcher.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            if torch.is_tensor(getattr(dispatcher, name)):
                setattr(dispatcher, name, getattr(dispatcher, name).numpy())
    return tokens_per_expert


def _is_cuda(device) -> bool:
    """Whether `device` names a CUDA device (a bare index does)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaOnCpu(TorchFunctionMode):
    """Megatron's optimizer, pipeline schedules and checkpoint strategies create small tensors
    (loss scale, found-inf flags, grad norms, token counts) with `device="cuda"` or move them with
    `.cuda()`, and its mixed-precision optimizer sorts parameters by `param.type()` in CUDA's
    spelling: here those tensors are made on the CPU, `.cuda()` keeps a tensor where it is, and
    `.type()` answers in CUDA's spelling."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """`grouped_gemm.ops.gmm`: rows of `a` in consecutive groups of `batch_sizes`, group i times `b[i]`."""
    outputs, start = [], 0
    for i, rows in enumerate(batch_sizes.tolist()):
        weight = b[i].t() if trans_b else b[i]
        outputs.append(a[start:start + rows] @ weight)
        start += rows
    return torch.cat(outputs)


class MLACoreAttention(torch.nn.Module):
    """softmax(q k^T * scale) v for multi-latent attention, in place of TransformerEngine's
    DotProductAttention (CUDA only), which Megatron's MLA expects: Megatron's own
    DotProductAttention takes one head size, and MLA's q/k heads (nope + rope part) are larger
    than its v heads. It holds no weights."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [batch, heads, sequence, head size]
        scores = (q @ k.transpose(-1, -2)).float() * self.softmax_scale
        probs = torch.softmax(scores.masked_fill(attention_mask, float("-inf")), dim=-1).to(v.dtype)
        out = probs @ v
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)  # [sequence, batch, heads * v size]


def causal_mask(length: int) -> torch.Tensor:
    """Megatron's attention mask for one causal sequence: True where attention is masked."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]


# --- the model -------------------------------------------------------------------------------


def build_bridge(args: argparse.Namespace, shape: Shape):
    """mbridge's bridge for the model, its TransformerConfig adjusted for CPU, building with the
    local layer spec."""
    from mbridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from transformers import CONFIG_MAPPING

    fields = hf_config(args.model, shape, args.tied, args.dtype)
    config = CONFIG_MAPPING[fields["model_type"]](**{k: v for k, v in fields.items() if k not in ("model_type", "dtype", "torch_dtype")})
    # mbridge 0.15.1 reads `rope_theta` (and GLM's `partial_rotary_factor`) as attributes;
    # transformers 5 keeps them in rope_parameters.
    config.rope_theta = fields["rope_theta"]
    if "partial_rotary_factor" in fields:
        config.partial_rotary_factor = fields["partial_rotary_factor"]
    if args.model == "deepseek_v3":
        use_current_mla_field_names()
    bridge = AutoBridge.from_config(config, dtype=getattr(torch, args.dtype))
    bridge.set_extra_args(**cpu_overrides(args))

    def local_spec(vp_stage=None):
        c = bridge.config
        if isinstance(c.moe_layer_freq, list):  # dense layers, then MoE ones: a block spec
            block = get_gpt_decoder_block_spec(c, use_transformer_engine=False, normalization=c.normalization,
                                               vp_stage=vp_stage)
            if c.multi_latent_attention:
                for layer in block.layer_specs:
                    layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
            return block
        return get_gpt_layer_local_spec(
            num_experts=c.num_moe_experts, moe_grouped_gemm=c.moe_grouped_gemm, qk_layernorm=c.qk_layernorm,
            normalization=c.normalization,
        )

    bridge._get_transformer_layer_spec = local_spec
    return bridge


def use_current_mla_field_names() -> None:
    """mbridge 0.15.1's DeepSeek-V3 bridge passes Megatron's MLA config the yarn field by its
    older name, `max_position_embeddings`, which Megatron-Core 0.16 calls
    `original_max_position_embeddings` (the same number: the length yarn's scaling starts from)."""
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge
    from megatron.core.transformer import MLATransformerConfig

    def config_class(**fields):
        fields["original_max_position_embeddings"] = fields.pop("max_position_embeddings")
        return MLATransformerConfig(**fields)

    DeepseekV3Bridge.TransformerConfigClass = staticmethod(config_class)


class TENamedView:
    """The live GPTModel as mbridge reads it, its parameters under the names Megatron's
    TransformerEngine spec gives the same tensors: what `export_weights` and its name mapping
    touch (`decoder.layers` for layer numbers, `named_parameters`, `state_dict`)."""

    def __init__(self, model: torch.nn.Module):
        self.decoder = getattr(model, "decoder", None)
        self.params = []
        for name, param in model.named_parameters():
            self.params.extend(self.te_named(model, name, param))
        # The router's score-correction bias is a buffer, which mbridge finds in `state_dict`.
        self.buffers = [(name, buffer) for name, buffer in model.named_buffers() if name.endswith(".router.expert_bias")]

    @staticmethod
    def te_named(model: torch.nn.Module, name: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        parts = name.split(".")  # decoder.layers.L.<module path>.<parameter>
        if ".mlp.experts.local_experts." in name:  # SequentialMLP: ...mlp.experts.local_experts.E.linear_fcN.weight
            return [(f"decoder.layers.{parts[2]}.mlp.experts.{parts[7]}.weight{parts[6]}", param)]
        if name.endswith((".mlp.experts.weight1", ".mlp.experts.weight2")):
            # The legacy GroupedMLP keeps one weight of all its local experts in one tensor, each
            # expert's transposed: weight1 views as [experts, hidden, 2 * ffn], weight2 as
            # [experts, ffn, hidden].
            experts = model.get_submodule(name.rsplit(".", 1)[0])
            hidden = experts.config.hidden_size
            fc1 = parts[-1] == "weight1"
            stacked = param.view(experts.num_local_experts, hidden, -1) if fc1 else param.view(experts.num_local_experts, -1, hidden)
            fc = "linear_fc1" if fc1 else "linear_fc2"
            return [(f"decoder.layers.{parts[2]}.mlp.experts.{fc}.weight{e}", w.t()) for e, w in enumerate(stacked)]
        if model.config.multi_latent_attention:
            # The TE spec's MLA keeps `input_layernorm` apart and fuses the q and kv latent norms
            # into the up projections that follow them.
            for local, fused in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
                if name.endswith(f".self_attention.{local}.weight"):
                    return [(name.replace(f"{local}.weight", f"{fused}.layer_norm_weight"), param)]
        elif name.endswith(".input_layernorm.weight"):
            return [(name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), param)]
        # The TE spec fuses the pre-MLP norm into linear_fc1 in dense layers only; its MoE layers
        # keep `pre_mlp_layernorm`, as mbridge's MoE bridges map it.
        if name.endswith(".pre_mlp_layernorm.weight") and ".mlp.linear_fc1." not in name and not model.config.num_moe_experts:
            return [(name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), param)]
        return [(name, param)]

    def named_parameters(self):
        return iter(self.params)

    def state_dict(self):
        return dict(self.params + self.buffers)


def te_spec_keys(model: torch.nn.Module, sharded: dict) -> dict:
    """The model's sharded state dict under the checkpoint keys Megatron-Core 0.16.1's
    TransformerEngine spec (`get_gpt_layer_with_transformer_engine_spec`) saves the same tensors
    with, where they differ from the local spec's (`get_gpt_layer_local_spec`, whose
    `sharded_state_dict_keys_map` already gives dense layers TE's fused norm names):
    - an MoE layer's pre-MLP norm is TE's `TENorm`, `pre_mlp_layernorm.weight`, where the local
      spec's keys map names it `mlp.linear_fc1.layer_norm_weight`;
    - multi-latent attention fuses the q and kv latent norms into `linear_q_up_proj` and
      `linear_kv_up_proj` (`TELayerNormColumnParallelLinear`: `layer_norm_weight`), and a dense
      layer's pre-MLP norm into `mlp.linear_fc1` (its `pre_mlp_layernorm` is IdentityOp);
    - TE's `TEDotProductAttention` saves an `_extra_state` of its own (`core_attention`).
    The keys are changed on the saved objects only: the dict's keys (the modules' paths) stay."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def layer_of(path: str):
        parts = path.split(".")
        return model.decoder.layers[int(parts[2])] if parts[:2] == ["decoder", "layers"] else None

    renamed = {}
    for path, item in sharded.items():
        layer = layer_of(path)
        if layer is not None and isinstance(item, ShardedTensor):
            moe = isinstance(layer.mlp, MoELayer)
            if model.config.multi_latent_attention:
                renames = {".self_attention.q_layernorm.weight": ".self_attention.linear_q_up_proj.layer_norm_weight",
                           ".self_attention.kv_layernorm.weight": ".self_attention.linear_kv_up_proj.layer_norm_weight"}
                if not moe:
                    renames[".pre_mlp_layernorm.weight"] = ".mlp.linear_fc1.layer_norm_weight"
            else:
                renames = {".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight"} if moe else {}
            for local, te in renames.items():
                if item.key.endswith(local):
                    item = dataclasses.replace(item, key=item.key[: -len(local)] + te)
        renamed[path] = item
        if layer is not None and isinstance(item, ShardedObject) and path.endswith(".self_attention.linear_proj._extra_state"):
            attention = path.replace(".linear_proj.", ".core_attention.")
            renamed[attention] = dataclasses.replace(item, key=item.key.replace(".linear_proj.", ".core_attention."), data=None)
    return renamed


def model_sharded_state_dict(args: argparse.Namespace, model: torch.nn.Module, metadata: dict | None = None) -> dict:
    """The model's sharded state dict under the names of the layer spec `--names` saves with."""
    sharded = model.sharded_state_dict(metadata=metadata)
    return te_spec_keys(model, sharded) if args.names == "te" else sharded


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


# --- one rank --------------------------------------------------------------------------------


def join_gloo(rank: int, world: int, rendezvous: str, timeout_s: float = RANK_TIMEOUT_S) -> None:
    """This process as gloo rank `rank` of `world`, meeting the others at the file `rendezvous`,
    one thread each (the Megatron writers' ranks: this one's and the Megatron-Bridge ones')."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    faulthandler.enable()  # a crash in a rank (gloo, a kernel) shows where it was
    # A rank that fails leaves the others waiting in a collective: the timeout turns that into an error.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)


def run_rank(rank: int, args: argparse.Namespace, world: int, rendezvous: str) -> None:
    """One gloo rank: build, train `--steps` steps and save as verl's Megatron actor does."""
    join_gloo(rank, world, rendezvous)
    install_cpu_stand_ins()
    with CudaOnCpu():
        train_and_save(rank, args)
    dist.barrier()
    dist.destroy_process_group()


def train_and_save(rank: int, args: argparse.Namespace) -> None:
    """Megatron's parallel state, model, DDP, optimizer and pipeline schedule, as verl's Megatron
    actor builds them (through mbridge); `--steps` steps on random tokens, then the save and the
    references."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep,
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    # Megatron-LM seeds each pipeline stage apart (100 * stage); the expert ranks are seeded
    # apart too, so that their experts start distinct (the CPU initialisation draws every rank's
    # weights from this generator). DDP then broadcasts the dense weights across data parallel.
    seed = SEED + 100 * pp_rank + 10 * ep_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    shape = Shape()
    bridge = build_bridge(args, shape)
    config = bridge.config
    provider = bridge._model_provider([])
    model = provider(pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if config.bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=bool(args.optimizer)),
        model,
    )
    ddp.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, bf16=config.bf16, params_dtype=config.params_dtype,
                        use_distributed_optimizer=bool(args.optimizer), clip_grad=1.0),
        [ddp],
    )
    # A constant learning rate, scheduled by Megatron's scheduler (its state is saved with --optimizer).
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=max(args.steps, 1),
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=max(args.steps, 1), wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return losses, loss_func

    for step in range(1, args.steps + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        generator = torch.Generator().manual_seed(SEED + 1000 * step + dp_rank)
        tokens = torch.randint(shape.vocab, (BATCH, SEQ_LEN + 1), generator=generator)
        batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:].contiguous(),
                     position_ids=torch.arange(SEQ_LEN).expand(BATCH, -1), attention_mask=causal_mask(SEQ_LEN))
        forward_backward(forward_step_func=forward_step, data_iterator=iter([batch]), model=[ddp],
                         num_microbatches=1, seq_length=SEQ_LEN, micro_batch_size=BATCH, forward_only=False)
        updated, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        if rank == 0:
            print(f"step {step}: updated={updated} grad_norm={grad_norm}", flush=True)

    save(args, ddp, optimizer, scheduler)
    dist.barrier()
    exported = mbridge_export(bridge, unwrap(ddp))
    logits = prompt_logits(reloaded_in_float32(args, shape), forward_backward)
    if rank == 0:
        write_references(args, logits, exported)
        write_hf_config(args, shape)


def checkpoint_dir(args: argparse.Namespace) -> str:
    if args.layout == "verl":
        return os.path.join(args.out, "actor", "dist_ckpt")
    return os.path.join(args.out, f"iter_{args.steps:07d}")


def save(args: argparse.Namespace, ddp, optimizer, scheduler) -> None:
    """The trainer's state dict, saved with Megatron's dist_checkpointing (torch_dist)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    # Megatron-LM 0.16's sharded state dict metadata. The distributed optimizer's own default
    # format, 'fully_sharded_model_space' (which verl's checkpoint manager gets, passing none),
    # raises in 0.16.1: its ShardedTensors use flattened_range, which 0.16 rejects.
    metadata = dict(distrib_optim_sharding_type=args.optimizer or "dp_reshardable", singleton_local_shards=False,
                    chained_optim_avoid_prefix=True,
                    dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    state = {"model": model_sharded_state_dict(args, unwrap(ddp), metadata)}
    if args.optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=metadata)
        state["lr_scheduler" if args.layout == "verl" else "opt_param_scheduler"] = scheduler.state_dict()
    # The RNG states as verl and Megatron-LM keep them: one object per (pp, tp) rank.
    rng = {
        "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    state["rng_state"] = ShardedObject(
        "rng_state", [rng],
        (parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    if args.layout == "megatron-lm":
        state.update(args=megatron_lm_args(args, ddp.config), checkpoint_version=3.0, iteration=args.steps)
    directory = checkpoint_dir(args)
    os.makedirs(directory, exist_ok=True)
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    dist_checkpointing.save(state, directory, sharded_strategy=strategy, validate_access_integrity=True)
    if args.layout == "megatron-lm" and dist.get_rank() == 0:
        with open(os.path.join(args.out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(args.steps))


def megatron_lm_args(args: argparse.Namespace, config) -> argparse.Namespace:
    """The model-structure fields of the `args` Namespace Megatron-LM pickles into common.pt."""
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        group_query_attention=config.num_query_groups != config.num_attention_heads, kv_channels=config.kv_channels,
        padded_vocab_size=Shape().vocab, max_position_embeddings=Shape().max_positions,
        position_embedding_type="rope", normalization=config.normalization, norm_epsilon=config.layernorm_epsilon,
        swiglu=config.gated_linear_unit, add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm, untie_embeddings_and_output_weights=not args.tied,
        num_experts=config.num_moe_experts, moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_router_topk=config.moe_router_topk, moe_grouped_gemm=config.moe_grouped_gemm,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep,
        bf16=config.bf16, params_dtype=config.params_dtype, iteration=args.steps, ckpt_format="torch_dist",
        use_distributed_optimizer=bool(args.optimizer),
    )


def reloaded_in_float32(args: argparse.Namespace, shape: Shape) -> torch.nn.Module:
    """A float32 model with SequentialMLP experts (whatever was trained), built as the trained one
    was and loaded from the saved checkpoint with Megatron's own `dist_checkpointing.load`: the
    model the logits are computed with."""
    from megatron.core import dist_checkpointing, parallel_state

    float32 = argparse.Namespace(**dict(vars(args), dtype="float32", experts="sequential"))
    model = build_bridge(float32, shape)._model_provider([])(
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    )
    sharded = model_sharded_state_dict(args, model)
    state = dist_checkpointing.load({"model": sharded}, checkpoint_dir(args))
    own = model.state_dict()  # TE's attention state, which --names te adds, is not the local model's
    model.load_state_dict({path: value for path, value in state["model"].items() if path in own})
    return model


def prompt_logits(model, forward_backward) -> torch.Tensor:
    """The logits of `model` on PROMPT_IDS through the pipeline schedule (forward only), gathered
    across TP on the last stage, and from there to every rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
    )

    tokens = torch.tensor(PROMPT_IDS)
    batch = dict(tokens=tokens, position_ids=torch.arange(tokens.shape[1])[None], attention_mask=causal_mask(tokens.shape[1]))

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], b["attention_mask"])

        def collect(output, non_loss_data=False):
            return gather_from_tensor_model_parallel_region(output).float()

        return output, collect

    model.eval()
    with torch.no_grad():
        collected = forward_backward(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=1, forward_only=True, collect_non_loss_data=True,
        )
    mine = collected[0] if parallel_state.is_pipeline_last_stage() else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # rank 0 writes what the last stage computed
    return next(logits for logits in everyone if logits is not None)


def mbridge_export(bridge, model) -> dict[str, torch.Tensor]:
    """mbridge's export of the live model (every rank takes part), cloned on rank 0."""
    exported = {}
    for name, tensor in bridge.export_weights([TENamedView(model)]):
        if dist.get_rank() == 0:
            exported[name] = tensor.detach().clone().contiguous()
    return exported


def write_references(args: argparse.Namespace, logits, exported: dict) -> None:
    from safetensors.torch import save_file

    reference = os.path.join(args.out, "reference")
    os.makedirs(reference, exist_ok=True)
    save_file(exported, os.path.join(reference, "mbridge.safetensors"))
    save_file({"logits": logits.contiguous()}, os.path.join(reference, "logits.safetensors"))
    with open(os.path.join(reference, "keys.json"), "w") as f:
        json.dump(describe_checkpoint(checkpoint_dir(args)), f, indent=1)


def describe_checkpoint(directory: str) -> dict:
    """The saved `.metadata`: each key's global shape and dtype (or bytes) and its chunks, and
    every class the pickle names."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    named = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            named.add(f"{module}.{name}")
            return super().find_class(module, name)

    with open(os.path.join(directory, ".metadata"), "rb") as f:
        Recording(f).load()
    metadata = FileSystemReader(directory).read_metadata()
    keys = {}
    for key, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            keys[key] = dict(shape=list(item.size), dtype=str(item.properties.dtype).removeprefix("torch."),
                             chunks=[[list(c.offsets), list(c.sizes)] for c in item.chunks])
        else:
            keys[key] = dict(bytes=True)
    return dict(keys=keys, files=sorted(os.listdir(directory)), metadata_globals=sorted(named))


def write_hf_config(args: argparse.Namespace, shape: Shape) -> None:
    folder = os.path.join(args.out, "actor", "huggingface") if args.layout == "verl" else os.path.join(args.out, "hf")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(args.model, shape, args.tied, args.dtype), f, indent=2)


def parse(argv: list[str]) -> argparse.Namespace:
    """One checkpoint's arguments, checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=sorted(HF_NAMES), required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    tying = parser.add_mutually_exclusive_group(required=True)
    tying.add_argument("--tied", dest="tied", action="store_true")
    tying.add_argument("--untied", dest="tied", action="store_false")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--experts", choices=["sequential", "grouped"], default="sequential")
    parser.add_argument("--layout", choices=["verl", "megatron-lm"], default="verl")
    parser.add_argument(
        "--optimizer", nargs="?", const="dp_reshardable", choices=["dp_reshardable", "fully_reshardable"],
        help="train with the distributed optimizer and save its state, in this format (default dp_reshardable)",
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--names", choices=["local", "te"], default="local",
                        help="save under the local layer spec's checkpoint keys or TransformerEngine's (`te_spec_keys`)")
    args = parser.parse_args(argv)
    world = args.tp * args.pp * args.ep
    if world > MAX_RANKS:
        parser.error(f"tp * pp * ep is {world}; at most {MAX_RANKS} ranks")
    if Shape().layers % args.pp:
        parser.error(f"--pp must divide the {Shape().layers} layers")
    if args.ep > 1 and args.model not in MOE_MODELS:
        parser.error("--ep takes an MoE model")
    if args.tp > 1 and args.model in MOE_MODELS:
        parser.error("Megatron's MoE layer trains with TP only under sequence parallelism, which the local "
                     "spec's torch norm refuses: MoE models take --tp 1")
    if args.names == "te" and args.optimizer:
        parser.error("--names te renames the model's keys, which the distributed optimizer's state is keyed by: "
                     "it takes no --optimizer")
    if args.experts == "grouped" and args.dtype != "bfloat16":
        parser.error("Megatron's GroupedMLP computes in bfloat16 only: --experts grouped takes --dtype bfloat16")
    return args


def write(args: argparse.Namespace) -> None:
    """Train and save one checkpoint on tp * pp * ep gloo ranks, forked from this process: each
    starts with Megatron-Core, mbridge and transformers imported (`import_megatron`), which
    spawning would import again in every rank, for every checkpoint."""
    world = args.tp * args.pp * args.ep
    with tempfile.TemporaryDirectory(prefix="megatron-ranks-") as scratch:
        mp.start_processes(run_rank, args=(args, world, os.path.join(scratch, "rendezvous")), nprocs=world,
                           start_method="fork")


def import_megatron() -> None:
    """Import what the ranks run, before they are forked (no thread or process group is started)."""
    import mbridge  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401


def main() -> None:
    """One checkpoint from the command line's arguments, or with `--batch FILE`, every one that
    FILE (JSON: a list of argument lists) names, one after another in this process."""
    import sys

    argv = sys.argv[1:]
    batches = [parse(arguments) for arguments in json.load(open(argv[1]))] if argv[:1] == ["--batch"] else [parse(argv)]
    import_megatron()
    for args in batches:
        write(args)


if __name__ == "__main__":
    main()
