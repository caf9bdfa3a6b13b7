"""Writes the `torch_dist` checkpoint Megatron-Core saves for a tiny Hugging Face model of an
architecture whose Megatron modules exist only as TransformerEngine or CUDA-kernel code, made
with Megatron-Core's and Megatron-Bridge's own code, and Megatron-Bridge's own export of it.

Run with the Python of `megatron_bridge_env.megatron_bridge_python` (Megatron-Bridge 0.6.2,
Megatron-Core 0.19.2, transformers 5.12.1, on CPU), not the project's:

    python megatron_bridge_registry_save.py --out DIR --arch ARCH [--tp N] [--mtp N]
        [--dtype float32|bfloat16]
    python megatron_bridge_registry_save.py --batch FILE   # a JSON list of such argument lists

ARCH is a Hugging Face class name: Qwen3NextForCausalLM (gated DeltaNet linear attention mixed
with gated full attention, MoE with a gated shared expert), Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration (GatedDeltaNet),
NemotronHForCausalLM and FalconH1ForCausalLM (Mamba-2 mixers).

How each checkpoint is made (every architecture the same way: the REAL Megatron modules)
----------------------------------------------------------------------------------------
1. A tiny Hugging Face model of ARCH (transformers' own class; hidden 64, 4 layers mixing both
   kinds, Falcon-H1 2 layers each holding both),
   every parameter given distinct random values (norms and biases included; fixed seed), saved
   with `save_pretrained`. With `--mtp N`, random multi-token-prediction tensors `mtp.*` of the
   shapes Megatron-Bridge's mapping registry reads are added to its safetensors (transformers
   itself drops them on load, as it does for the released Qwen3-Next/Qwen3.5 checkpoints).
2. `--tp` gloo ranks (default 2), forked from this process, each with
   `parallel_state.initialize_model_parallel(tp)`, build Megatron-Bridge's own provider for it
   (`AutoBridge.from_hf_pretrained(...).to_megatron_provider()`, i.e. the bridge's own
   `provider_bridge`), and from it Megatron's own model (`provide_distributed_model`): `GPTModel`
   with Megatron-Core's `get_transformer_block_with_experimental_attention_variant_spec`
   (Qwen3-Next/Qwen3.5 text), Megatron-Bridge's `Qwen3VLModel` (Qwen3.5 VL), Megatron-Core's
   `HybridModel` with its `hybrid_stack_spec` (Nemotron-H), Megatron-Bridge's `FalconH1Model`
   with its `falconh1_stack_spec` (Falcon-H1): `GatedDeltaNet`, `MambaMixer`, `MambaLayer`,
   `TransformerLayer`, `MoELayer`, `MultiTokenPredictionBlock`, ... each its real class.
3. Megatron-Bridge's own `load_hf_weights` fills it from the Hugging Face folder: its
   `mapping_registry()` (`AutoMapping`, `QKVMapping`, `GDNLinearMapping`, `GDNConv1dMapping`,
   `MambaInProjMapping`, `RMSNorm2ZeroCenteredRMSNormMapping`, ...) and each mapping's
   `hf_to_megatron`, each rank keeping its TP shard.
4. Megatron-Core's own `dist_checkpointing.save({"model": model.sharded_state_dict()}, ...)` with
   the torch_dist strategy writes `DIR/model/dist_ckpt/` (`.metadata`, `__<rank>_0.distcp`,
   `metadata.json`; the common state is the `common_state` byte object, no `common.pt`): every key, the in_proj/conv1d splits (`_split_tensor_factory`
   in `GatedDeltaNet.sharded_state_dict` and `MambaMixer.sharded_state_dict`), the layer stacking
   (`TransformerBlock`/`HybridStack` sharded offsets) are Megatron's own.
5. `DIR/reference/bridge.safetensors`: Megatron-Bridge's own `export_hf_weights` of that model
   (gathered across TP by the bridge); `DIR/reference/logits.safetensors`: the ORIGINAL Hugging Face
   model's float32 logits on `PROMPT_IDS` (`{"logits": (1, 8, vocab)}`; of a bfloat16 case, from its
   values rounded to bfloat16, as the checkpoint holds them); `DIR/reference/keys.json`:
   every key of the saved `.metadata` with its global shape and dtype (or `bytes`), its chunks,
   the checkpoint's files and the classes the `.metadata` pickle names; `DIR/model/huggingface/`:
   the Hugging Face config (and the processor's files for the VL models), no weights.
   The writer checks that the export equals the original Hugging Face tensors (all mappings used
   here are lossless in float32) and raises otherwise.

What is stood in, and why (`install_cpu_stand_ins`; none of it decides a saved name, shape or value)
----------------------------------------------------------------------------------------------------
- TransformerEngine is absent (CUDA only), and the specs of these models name only TE modules.
  Before Megatron-Bridge and the spec modules are imported, the TE classes in
  `megatron.core.extensions.transformer_engine` are replaced by CPU modules holding the same
  parameters under the same names and saving the same sharded state dict, so that Megatron's
  own `TESpecProvider`, `hybrid_stack_spec`, `HybridStack`, Megatron-Bridge's `falconh1_stack_spec`
  and `Qwen3VLModel` bind them (`check_stand_ins` confirms it):
  `TELayerNormColumnParallelLinear` -> `LayerNormColumnParallelLinear` below (Megatron's
  `ColumnParallelLinear` plus TE's `layer_norm_weight`/`layer_norm_bias`; sharded
  `{"weight": 0, "bias": 0}` as TE's, the norm weight replicated); `TENorm` -> `Norm` below (TE's
  LayerNorm/RMSNorm incl. zero-centred gamma, which torch's `WrappedTorchNorm` refuses; `weight`
  (+ `bias`) replicated); `TEColumnParallelLinear`/`TERowParallelLinear` -> Megatron's
  `ColumnParallelLinear`/`RowParallelLinear`; `TEDotProductAttention` -> Megatron's
  `DotProductAttention` (neither holds a tensor here); `TELinear` (MLA/DSA only) -> absent.
  Without TE's grouped linears, `TESpecProvider` picks its own fallback for the experts,
  Megatron's `SequentialMLP`, whose sharded state dict is by design interchangeable with
  `TEGroupedMLP`'s (`mlp.experts.experts.linear_fcN.weight`, experts on a leading axis); the
  `_extra_state` byte objects differ (one per local expert here) and hold nothing either way.
  Megatron-Bridge 0.6.2's Qwen3.5-MoE registry maps MTP experts only in the grouped layout, so
  the MoE Qwen3.5 models are written without `--mtp` (Qwen3-Next's maps both).
- `GatedDeltaNet` refuses to build without flash-linear-attention (`HAVE_FLA`), whose Triton
  kernels only its forward runs: the flag is set, and Megatron's own pure-torch
  `torch_chunk_gated_delta_rule` takes the kernel's place.
- `MambaMixer` refuses to build without mamba_ssm (`HAVE_MAMBA_SSM`), whose Triton kernels only
  its forward runs, and its gated norm `ExtendedRMSNorm` derives from mamba_ssm's `RMSNormGated`
  (a MagicMock without it): the flag is set, and `GatedRMSNorm` below (mamba_ssm's gated RMSNorm:
  `weight`, no bias; `ExtendedRMSNorm.sharded_state_dict`'s TP split on axis 0) takes its place.
- CUDA calls on the build and save paths: `torch.cuda.current_device()` is the CPU here, the
  CUDA RNG tracker's `fork` a null context, `torch.cuda.synchronize` a no-op.
- Provider settings for CPU: float32 (or `--dtype`) parameters, fusions off, the all-gather MoE
  dispatcher, no grouped GEMM (SequentialMLP, see above), no shared-expert overlap, no random initialisation (every tensor is loaded). None
  changes a saved tensor.
- transformers 5.12.1 saves Nemotron-H's embedding as `backbone.embedding.weight`; the released
  checkpoints (and the bridge) spell it `backbone.embeddings.weight` (`released_names`).

Megatron's own behaviour worth knowing when reading these checkpoints: megatron-core 0.19.2
writes no `common.pt` (the common state is the byte object `common_state/shard_0_1`); models
mixing layer kinds are saved per layer (`decoder.layers.<N>.*`: the Qwen3-Next/Qwen3.5 providers
set `hetereogenous_dist_checkpoint`, `HybridStack`/`FalconH1Stack` always do), a homogeneous tower
stacked (`vision_model.decoder.layers.*` (layers, ...)); GPT multi-token-prediction layers are
saved under `mtp.layers.<i>.transformer_layer.*` (the module is `mtp_model_layer`;
`MultiTokenPredictionLayer.sharded_state_dict` renames it); Falcon-H1 is written at TP 1 because
`FalconH1Layer.sharded_state_dict` gives its norms no TP group, so at TP > 1 every rank claims
replica 0 and Megatron-Core's save refuses the plan (TE or not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]
SEED = 1234
RANK_TIMEOUT_S = 300
ARCHS = (
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration", "NemotronHForCausalLM", "FalconH1ForCausalLM",
)
# Those whose Hugging Face checkpoints carry `mtp.*` and whose bridges map them in the layout built
# here (Megatron-Bridge 0.6.2 maps Qwen3.5-MoE's MTP experts only in TE's grouped layout)
MTP_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
VOCAB, HIDDEN = 128, 64


# --- the tiny Hugging Face models ------------------------------------------------------------


def qwen_gdn_text(moe: bool, mtp: int) -> dict:
    """A Qwen3-Next / Qwen3.5 text config: 4 layers, 3 gated-DeltaNet then 1 full attention."""
    config = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, full_attention_interval=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
    )
    if moe:
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if mtp:
        config["mtp_num_hidden_layers"] = mtp
    return config


def hf_config(arch: str, mtp: int):
    """The tiny Hugging Face config of `arch`."""
    import transformers

    if arch == "Qwen3NextForCausalLM":
        return transformers.Qwen3NextConfig(**qwen_gdn_text(moe=True, mtp=mtp))
    if arch == "Qwen3_5ForCausalLM":
        return transformers.Qwen3_5TextConfig(**qwen_gdn_text(moe=False, mtp=mtp))
    if arch == "Qwen3_5MoeForCausalLM":
        return transformers.Qwen3_5MoeTextConfig(**qwen_gdn_text(moe=True, mtp=mtp))
    if arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        moe = "Moe" in arch
        text = qwen_gdn_text(moe=moe, mtp=mtp)
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 1, 1], mrope_interleaved=True)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN, num_position_embeddings=16)
        cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        return cls(text_config=text, vision_config=vision, image_token_id=120, video_token_id=121,
                   vision_start_token_id=122, vision_end_token_id=123, tie_word_embeddings=False)
    if arch == "NemotronHForCausalLM":
        return transformers.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, layers_block_type=["mamba", "moe", "attention", "mlp"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mlp_hidden_act="relu2",
            ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2,
            chunk_size=16, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, num_experts_per_tok=2, max_position_embeddings=128,
            tie_word_embeddings=False, num_nextn_predict_layers=0,
        )
    if arch == "FalconH1ForCausalLM":
        return transformers.FalconH1Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, mamba_rms_norm=True,
            mamba_norm_before_gate=False, max_position_embeddings=128, tie_word_embeddings=False,
        )
    raise ValueError(arch)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter of `model` given distinct random values (seeded): a tensor its
    initialisation left constant (a norm's ones or zeros, dt_bias's ones) keeps that level plus
    noise, every other one becomes small Gaussian noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            flat = parameter.detach().float().flatten()
            level = flat[0].item() if flat.numel() and bool((flat == flat[0]).all()) else 0.0
            scale = 0.1 if parameter.dim() == 1 else 0.5 / math.sqrt(parameter.shape[-1])
            noise = torch.randn(parameter.shape, generator=generator) * scale
            parameter.copy_((level + noise).to(parameter.dtype))


def build_hf_model(arch: str, mtp: int, dtype: str = "float32"):
    """The tiny Hugging Face model of `arch`, in float32, randomised; for a bfloat16 case its
    values rounded to bfloat16 (what the checkpoint holds, which the reference logits are then
    computed from)."""
    import transformers
    from transformers.integrations import hub_kernels

    # transformers' own torch paths for the Mamba and DeltaNet layers: no kernels fetched from the Hub
    hub_kernels._kernels_available = False
    torch.manual_seed(SEED)
    config = hf_config(arch, mtp)
    config.architectures = [arch]
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    randomize(model, SEED)
    if dtype == "bfloat16":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16))
    return model


# --- stand-ins for TransformerEngine and the CUDA kernels -------------------------------------


def _norm(x: torch.Tensor, weight: torch.Tensor, bias, eps: float, rms: bool, zero_centered: bool) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    if rms:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps)
    gamma = weight.float() + 1 if zero_centered else weight.float()
    y = y * gamma
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


class Norm(torch.nn.Module):
    """TransformerEngine's `TENorm` (te.pytorch.LayerNorm / RMSNorm) on CPU: a `weight` (and for
    LayerNorm a `bias`) of `hidden_size`, with TE's `zero_centered_gamma` (the weight stores
    gamma - 1), which Megatron's torch norm refuses. Replicated in the sharded state dict, as
    Megatron's `sharded_state_dict_default` saves TE's norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False, **_):
        super().__init__()
        self.eps, self.rms = eps, config.normalization == "RMSNorm"
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 0.0 if self.zero_centered else 1.0,
                                                    dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for parameter in self.parameters():
            setattr(parameter, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised `x`."""
        return _norm(x, self.weight, self.bias, self.eps, self.rms, self.zero_centered)


def layer_norm_column_parallel_linear():
    """`LayerNormColumnParallelLinear`, made once Megatron-Core is importable."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """TransformerEngine's `TELayerNormColumnParallelLinear` (a norm fused into a column-parallel
        linear) on CPU: Megatron's `ColumnParallelLinear` (`weight`, `bias`, TP-split on axis 0)
        plus TE's `layer_norm_weight` (and `layer_norm_bias` for LayerNorm) of the input size, kept
        whole on every rank; the sharded state dict is TE's (`{"weight": 0, "bias": 0}`)."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, name=None):
            super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                             gather_output=gather_output, stride=stride, skip_bias_add=skip_bias_add,
                             skip_weight_param_allocation=skip_weight_param_allocation, is_expert=is_expert,
                             tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group)
            self.norm_eps, self.rms = config.layernorm_epsilon, config.normalization == "RMSNorm"
            self.zero_centered = config.layernorm_zero_centered_gamma
            self.layer_norm_weight = torch.nn.Parameter(
                torch.full((input_size,), 0.0 if self.zero_centered else 1.0, dtype=config.params_dtype))
            if not self.rms:
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            else:
                self.layer_norm_bias = None
            for parameter in (self.layer_norm_weight, self.layer_norm_bias):
                if parameter is not None:
                    setattr(parameter, "sequence_parallel", config.sequence_parallel)

        def forward(self, x, *args, **kwargs):
            """The norm, then Megatron's column-parallel linear (its output and bias)."""
            x = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.norm_eps, self.rms, self.zero_centered)
            return super().forward(x, *args, **kwargs)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """TE's `TELayerNormColumnParallelLinear.sharded_state_dict`."""
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state_dict = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0, "bias": 0}, sharded_offsets,
                                                       tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    return LayerNormColumnParallelLinear


class GatedRMSNorm(torch.nn.Module):
    """mamba_ssm's `RMSNormGated` (`mamba_ssm.ops.triton.layernorm_gated.RMSNorm`) on CPU, as
    Megatron's `ExtendedRMSNorm` wraps it: a `weight` of the TP-local inner size (no bias),
    normalised per group of `group_size`, gated by silu(z) after the norm
    (`norm_before_gate=False`); `ExtendedRMSNorm.sharded_state_dict`'s TP split on axis 0."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        """The grouped RMS norm of `x`, gated by silu(`z`)."""
        dtype = x.dtype
        x = x.float()
        if z is not None and not self.norm_before_gate:
            x = x * torch.nn.functional.silu(z.float())
        grouped = x.unflatten(-1, (-1, self.group_size))
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2) * self.weight.float()
        if z is not None and self.norm_before_gate:
            y = y * torch.nn.functional.silu(z.float())
        return y.to(dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron-Core's `ExtendedRMSNorm.sharded_state_dict` (megatron/core/ssm/mamba_mixer.py)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


TE_NAMES = ("TELayerNormColumnParallelLinear", "TENorm", "TEColumnParallelLinear", "TERowParallelLinear",
            "TEDotProductAttention", "TELinear")


class AbsentTELinear:
    """TransformerEngine's `TELinear` (a TP-duplicated linear), named only by the multi-latent and
    sparse attention specs of `hybrid_stack_spec`, which none of these models builds."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("TELinear has no CPU stand-in here (MLA/DSA layers are not built)")


def install_cpu_stand_ins() -> None:
    """Put the stand-ins the module docstring lists in place. Called before Megatron-Bridge and
    Megatron-Core's spec and model modules are imported, so that each module importing a TE class
    by name (`from megatron.core.extensions.transformer_engine import TENorm`: the TE spec
    provider, `hybrid_layer_specs`, `HybridStack`, Falcon-H1's and Qwen3-VL's modules) binds the
    stand-in; `check_stand_ins` confirms it afterwards."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    stand_ins = dict(zip(TE_NAMES, (layer_norm_column_parallel_linear(), Norm, ColumnParallelLinear,
                                    RowParallelLinear, DotProductAttention, AbsentTELinear)))
    for name, cpu in stand_ins.items():
        setattr(te_extension, name, cpu)
    from megatron.core.extensions import transformer_engine_spec_provider as te_spec_provider

    # No TE grouped GEMM: TESpecProvider's own fallback, a SequentialMLP of its column/row linears
    te_spec_provider.TEColumnParallelGroupedLinear = None
    te_spec_provider.TEActivationOp = None
    te_spec_provider.is_te_min_version = lambda *args, **kwargs: True
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variant_specs
    from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs

    for module in (variant_specs, gpt_layer_specs, moe_module_specs):  # each imported it only with TE present
        module.TESpecProvider = te_spec_provider.TESpecProvider
    # Only the forward passes run these kernels (flash-linear-attention, mamba_ssm)
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.gated_delta_net import common as gdn_common
    from megatron.core.ssm.gated_delta_net import gdn

    gdn_common.HAVE_FLA = True
    gdn.chunk_gated_delta_rule = gdn_common.torch_chunk_gated_delta_rule
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.ExtendedRMSNorm = GatedRMSNorm
    # CUDA calls on the build and save paths
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None


def check_stand_ins() -> None:
    """Every loaded Megatron module that names one of the replaced TE classes holds its stand-in."""
    from megatron.core.extensions import transformer_engine as te_extension

    # inference_layers subclasses the TE classes (for the inference-optimized specs only) and is
    # imported by megatron.core.tensor_parallel itself, before any stand-in can be put in place
    exempt = {"megatron.core.tensor_parallel.inference_layers"}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("megatron.") or module is None or module_name in exempt:
            continue
        for name in TE_NAMES:
            held = module.__dict__.get(name)
            if held is not None and held is not getattr(te_extension, name):
                raise RuntimeError(f"{module_name}.{name} was imported before the CPU stand-ins were installed")


# --- one rank --------------------------------------------------------------------------------


def cpu_provider(bridge, args: argparse.Namespace):
    """Megatron-Bridge's own provider for the model, with the CPU settings (module docstring)."""
    dtype = getattr(torch, args.dtype)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = args.tp
    provider.pipeline_model_parallel_size = 1
    provider.params_dtype = dtype
    provider.bf16, provider.fp16 = dtype == torch.bfloat16, False
    provider.autocast_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.sequence_parallel = False
    provider.perform_initialization = False
    provider.use_cpu_initialization = True
    for fusion in ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                   "persist_layer_norm", "apply_rope_fusion", "moe_permute_fusion", "moe_shared_expert_overlap",
                   "cross_entropy_loss_fusion", "fused_residual_rmsnorm"):
        if hasattr(provider, fusion):
            setattr(provider, fusion, False)
    if getattr(provider, "num_moe_experts", None):
        provider.moe_token_dispatcher_type = "allgather"
        provider.moe_grouped_gemm = False
    provider.finalize()
    return provider


def run_rank(rank: int, args: argparse.Namespace, hf_dir: str, rendezvous: str) -> None:
    """One gloo rank: Megatron's model of `hf_dir` at TP `args.tp`, loaded by Megatron-Bridge,
    saved by Megatron-Core, exported by Megatron-Bridge (rank 0 writes the export)."""
    from megatron_save import join_gloo

    join_gloo(rank, args.tp, rendezvous, RANK_TIMEOUT_S)
    from megatron.bridge import AutoBridge
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    torch.manual_seed(SEED)
    bridge = AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.float32)
    provider = cpu_provider(bridge, args)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                               init_model_with_meta_device=False)
    bridge.load_hf_weights(model)
    (module,) = [unwrap(m) for m in model]
    directory = os.path.join(args.out, "model", "dist_ckpt")
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save({"model": module.sharded_state_dict()}, directory,
                            sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    exported = {name: tensor.detach().to("cpu").clone().contiguous()
                for name, tensor in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    if rank == 0:
        from safetensors.torch import save_file

        os.makedirs(os.path.join(args.out, "reference"), exist_ok=True)
        save_file(exported, os.path.join(args.out, "reference", "bridge.safetensors"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Megatron model inside its wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


# --- the case --------------------------------------------------------------------------------


def add_mtp_tensors(hf_dir: str, config, mtp: int) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors as Qwen3-Next/Qwen3.5 checkpoints carry them (the shapes Megatron-
    Bridge's registry reads: `mtp.fc` (hidden, 2 hidden), its three norms, and one full-attention
    decoder layer `mtp.layers.<i>.*` like the model's own, experts per expert), appended to the
    folder's safetensors; the tensors added."""
    from safetensors.torch import load_file, save_file

    text = getattr(config, "text_config", config)
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    prefix = "model.language_model." if hasattr(config, "text_config") else "model."
    full = text.layer_types.index("full_attention")
    layer = f"{prefix}layers.{full}."
    hidden = text.hidden_size
    generator = torch.Generator().manual_seed(SEED + 7)
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
              "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    for i in range(mtp):
        for name, tensor in tensors.items():
            if not name.startswith(layer):
                continue
            rest = name[len(layer):]
            if rest.startswith("mlp.experts.") and rest.count(".") == 2:  # packed experts: per expert in MTP
                for expert in range(text.num_experts):
                    if rest.endswith("gate_up_proj"):
                        gate_up = tensor[expert]
                        half = gate_up.shape[0] // 2
                        shapes[f"mtp.layers.{i}.mlp.experts.{expert}.gate_proj.weight"] = tuple(gate_up[:half].shape)
                        shapes[f"mtp.layers.{i}.mlp.experts.{expert}.up_proj.weight"] = tuple(gate_up[half:].shape)
                    else:
                        shapes[f"mtp.layers.{i}.mlp.experts.{expert}.down_proj.weight"] = tuple(tensor[expert].shape)
            else:
                shapes[f"mtp.layers.{i}.{rest}"] = tuple(tensor.shape)
    added = {}
    for name, shape in sorted(shapes.items()):
        scale = 0.1 if len(shape) == 1 else 0.5 / math.sqrt(shape[-1])
        added[name] = (torch.randn(shape, generator=generator) * scale).contiguous()
    save_file({**tensors, **added}, path, metadata={"format": "pt"})
    return added


def image_processor(config):
    """The VL models' image processor (Qwen3.5 ships Qwen2-VL's), sized to the tiny vision tower."""
    from transformers import Qwen2VLImageProcessorPil

    vision = config.vision_config
    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                    merge_size=vision.spatial_merge_size)


def released_names(hf_dir: str, arch: str) -> None:
    """Tensor names as the released checkpoints spell them where transformers 5.12.1 saves others:
    Nemotron-H's embedding is `backbone.embeddings.weight` in nvidia's checkpoints and in
    Megatron-Bridge's registry; transformers saves it as `backbone.embedding.weight` (its
    conversion mapping renames it back on load, so both load)."""
    from safetensors.torch import load_file, save_file

    renames = {"NemotronHForCausalLM": {"backbone.embedding.weight": "backbone.embeddings.weight"}}.get(arch)
    if renames:
        path = os.path.join(hf_dir, "model.safetensors")
        tensors = load_file(path)
        save_file({renames.get(name, name): tensor for name, tensor in tensors.items()}, path, metadata={"format": "pt"})


def prompt_logits(model) -> torch.Tensor:
    """The original Hugging Face model's float32 logits on `PROMPT_IDS`."""
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT_IDS)).logits.float().contiguous()


def write(args: argparse.Namespace) -> None:
    """One case: the Hugging Face model, the ranks, then the references and the config folder."""
    from safetensors.torch import load_file, save_file

    model = build_hf_model(args.arch, args.mtp, args.dtype)
    with tempfile.TemporaryDirectory(prefix="megatron-bridge-registry-") as scratch:
        hf_dir = os.path.join(scratch, "hf")
        model.save_pretrained(hf_dir)
        released_names(hf_dir, args.arch)
        if args.mtp:
            add_mtp_tensors(hf_dir, model.config, args.mtp)
        original = load_file(os.path.join(hf_dir, "model.safetensors"))
        if os.path.exists(args.out):
            shutil.rmtree(args.out)
        mp.start_processes(run_rank, args=(args, hf_dir, os.path.join(scratch, "rendezvous")), nprocs=args.tp,
                           start_method="fork")
        huggingface = os.path.join(args.out, "model", "huggingface")
        shutil.copytree(hf_dir, huggingface, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        if hasattr(model.config, "vision_config"):
            image_processor(model.config).save_pretrained(huggingface)
    reference = os.path.join(args.out, "reference")
    save_file({"logits": prompt_logits(model)}, os.path.join(reference, "logits.safetensors"))
    from megatron_save import describe_checkpoint

    description = describe_checkpoint(os.path.join(args.out, "model", "dist_ckpt"))
    with open(os.path.join(reference, "keys.json"), "w") as f:
        json.dump(description, f, indent=1)
    check_export(args, original, load_file(os.path.join(reference, "bridge.safetensors")))


def check_export(args: argparse.Namespace, original: dict, exported: dict) -> None:
    """Megatron-Bridge's export must give back the original Hugging Face tensors: the same names,
    and in float32 the same values bit for bit; a bfloat16 checkpoint holds them rounded to
    bfloat16 (and the zero-centred norms' "- 1 ... + 1" rounds once more)."""
    missing, extra = sorted(set(original) - set(exported)), sorted(set(exported) - set(original))
    if missing or extra:
        raise SystemExit(f"{args.out}: export lacks {missing[:8]} ({len(missing)}), adds {extra[:8]} ({len(extra)})")
    for name, tensor in original.items():
        expected = tensor.to(getattr(torch, args.dtype)).float()
        got = exported[name].float()
        same = got.shape == expected.shape and (
            torch.equal(got, expected) if args.dtype == "float32" else torch.allclose(got, expected, rtol=2**-7, atol=2**-7))
        if not same:
            raise SystemExit(f"{args.out}: export of {name} differs from the Hugging Face tensor "
                             f"({tuple(got.shape)} vs {tuple(expected.shape)})")


def parse(argv: list[str]) -> argparse.Namespace:
    """One checkpoint's arguments, checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--mtp", type=int, default=0, help="multi-token-prediction layers (Qwen3-Next, Qwen3.5)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    if args.mtp and args.arch not in MTP_ARCHS:
        parser.error(f"--mtp takes one of {MTP_ARCHS}")
    if args.tp not in (1, 2):
        parser.error("--tp is 1 or 2 (the tiny models' head counts)")
    if args.tp > 1 and args.arch == "FalconH1ForCausalLM":
        # FalconH1Layer.sharded_state_dict saves its norm through `sharded_state_dict_default`
        # without the TP group, so every TP rank claims replica 0 of `decoder.layers.N.norm.weight`
        # and Megatron-Core's save refuses the plan ("Invalid access pattern"), with TE as without.
        parser.error("Megatron-Bridge 0.6.2's Falcon-H1 cannot be saved at TP > 1: --tp 1")
    return args


def import_megatron() -> None:
    """Import what the ranks run, with the stand-ins in place, before they are forked."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from megatron_bridge_imports import import_megatron_bridge

    install_cpu_stand_ins()
    import_megatron_bridge()
    import megatron.bridge.models  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.hybrid.hybrid_layer_specs  # noqa: F401
    check_stand_ins()


def main() -> None:
    """One checkpoint from the command line's arguments, or with `--batch FILE`, every one that
    FILE (JSON: a list of argument lists) names, one after another in this process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; nothing is fetched
    argv = sys.argv[1:]
    batches = [parse(arguments) for arguments in json.load(open(argv[1]))] if argv[:1] == ["--batch"] else [parse(argv)]
    import_megatron()
    for args in batches:
        write(args)


if __name__ == "__main__":
    main()
