"""Writes a real Megatron-Core `torch_dist` checkpoint of a tiny Hugging Face model, saved by
Megatron-Bridge 0.6.2 itself (on Megatron-Core 0.19.2) on CPU gloo ranks, and Megatron-Bridge's own
Hugging Face export of it.

Run with a Python that `megatron_bridge_env.megatron_bridge_python` made, not the project's:

    python megatron_bridge_save.py --out DIR --arch <Hugging Face architecture class name>
        [--tp N] [--pp N] [--ep N] [--etp N] [--vpp N] [--first-stage-layers N --last-stage-layers N]
        [--layout verl|megatron-lm] [--dtype float32|bfloat16] [--mtp N] [--tied|--untied]
        [--value-head] [--pad-vocab]
    python megatron_bridge_save.py --batch FILE   # FILE: a JSON list of such argument lists

Each checkpoint takes pp * lcm(tp, ep * etp) gloo ranks (at most 4), forked from this process, which
imports Megatron-Bridge once for a whole batch. The path is Megatron-Bridge's own, as verl's
Megatron backend and NeMo-RL drive it:

- a tiny Hugging Face model of the architecture (transformers 5.12.1, Megatron-Bridge's pin; the
  sizes of `TINY`, where the config has the field), every tensor distinct random values, seed
  fixed, written with `save_pretrained` (with `--mtp N`, N multi-token-prediction layers added to
  its safetensors under the names DeepSeek-V3 and GLM-4.5 checkpoints use, `add_mtp_layers`);
- `AutoBridge.from_hf_pretrained(folder)`, `to_megatron_provider(load_weights=True)`, the CPU
  settings of `cpu_provider` (dtypes, every fusion off, the local attention backend and layer
  spec, the all-gather MoE dispatcher, the parallel sizes), `provider.finalize()`, gloo and
  `parallel_state.initialize_model_parallel` initialised here, and
  `provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)`; with
  `--value-head`, verl's critic hook replaces the output layer with a hidden -> 1 value head;
- the save: `--layout megatron-lm`, Megatron-Bridge's `save_megatron_model(model, DIR)`
  (`DIR/iter_0000000/`, `DIR/latest_checkpointed_iteration.txt`) with the Hugging Face config in
  `DIR/hf/`; `--layout verl` (default), as verl's `MegatronCheckpointManager` saves
  (`save_like_verl`): `dist_checkpointing.save` of `{"model": sharded_state_dict, "rng_state"}`
  (`model0`, `model1`... per virtual stage) into `DIR/model/dist_ckpt/`, torch_dist, fully parallel
  over data-parallel ranks, with the Hugging Face config (and image processor) in
  `DIR/model/huggingface/`. No weights beside either.

It writes what an export must reproduce, into `DIR/reference/`:
- `bridge.safetensors`: every (name, tensor) of Megatron-Bridge's `export_hf_weights` of the live
  model, as the bridge names and types them (on-disk per-expert names for most MoE models,
  transformers' fused in-memory expert tensors for gpt-oss and Qwen3-VL-MoE), checked against the
  Hugging Face model it was loaded from (`check_export`: that is how the weights are known to have
  been loaded). Two departures, each recorded: rows Megatron's vocabulary padding adds are cut, and
  a critic's value head is `score.weight`;
- `logits.safetensors`: `{"logits": ...}`, the ORIGINAL Hugging Face model's float32 logits on
  `PROMPT_IDS` (text only for VLMs; from the bfloat16-rounded weights in a bfloat16 case; the
  `<Model>ForTokenClassification` critic's with `--value-head`);
- `keys.json`: every key of the saved `.metadata` with its global shape and dtype (or `bytes`) and
  chunks, the checkpoint's files and the classes the `.metadata` pickle names
  (`megatron_save.describe_checkpoint`).

Megatron-Bridge on CPU without TransformerEngine needs a few stand-ins, in this writer only, each
commented where it is made, none touching a weight: three CUDA calls on the save path
(`install_cpu_stand_ins`); Megatron-Core's local layer specs wherever a bridge asks for
TransformerEngine's (`use_local_specs`); the SequentialMLP expert names beside the grouped ones in
the bridges that map only the latter (`with_local_expert_mappings`); multi-latent attention's core
attention (`local_attention_for_mla`); and a zero-centred-gamma torch norm (`zero_centered_torch_norm`).
Architectures whose layers exist only as TransformerEngine modules (Gemma 2 and 3, EXAONE 4, GLM-5's
sparse attention, Qwen3-Next's and Qwen3.5's gated delta net) cannot be built here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]  # tests/support/models.py's prompt
SEED = 1234
MAX_RANKS = 4
RANK_TIMEOUT_S = 300


# --- the Hugging Face model ------------------------------------------------------------------

# The tiny sizes, each applied where the architecture's config has the field (or its text config).
TINY = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=128, max_position_embeddings=512, attention_dropout=0.0,
    # experts: 4 routed (every spelling of it), 2 per token, one shared where the model has shared experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, moe_intermediate_size=64,
    num_experts_per_tok=2, moe_k=2, n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    router_aux_loss_coef=0.0, aux_loss_alpha=0.0, n_group=1, topk_group=1,
    # one dense layer, then MoE layers, in the models that mix them
    first_k_dense_replace=1, moe_layer_start_index=1, moe_layer_end_index=3,
    # multi-latent attention
    q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    # sliding-window attention narrower than the prompt, so that the logits depend on it
    sliding_window=4,
    # Gemma 4's per-layer input embeddings and its global layers' wider heads
    vocab_size_per_layer_input=320, hidden_size_per_layer_input=16, global_head_dim=64,
)
# Per-layer kinds over the 4 layers
LAYER_KINDS = dict(
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
)
# The models whose multi-token-prediction layers Megatron-Bridge maps from `model.layers.<num_hidden_layers + i>.*`
MTP_MODEL_TYPES = ("deepseek_v3", "glm4_moe")
# What a model of the architecture has beyond the tiny sizes, by model type (the text config's for VLMs)
MODEL_FIELDS = {
    "glm4_moe": dict(attention_bias=True),  # GLM-4.5's q, k and v biases
    "qwen3_moe": dict(head_dim=32),  # wider than hidden / heads, as Qwen3-MoE's (transformers 5.12.1 derives it)
    # OLMoE's q and k norms span all heads, which Megatron-Bridge's OLMoE attention sizes for as many
    # key/value heads as query heads, as OLMoE has
    "olmoe": dict(num_key_value_heads=4),
    # the field Megatron-Bridge's HY-V3 bridge reads (one dense layer, as `mlp_layer_types` says),
    # which transformers 5.12.1's config lacks
    "hy_v3": dict(first_k_dense_replace=1),
    # mrope over (time, height, width) sections of the rotary frequencies: 16 of Qwen3-VL's 32-wide
    # heads, 8 of Qwen2.5-VL's 16-wide ones, 4 of GLM-4.5V's 16-wide ones (half of them rotary)
    "qwen3_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[6, 5, 5],
                                               mrope_interleaved=True)),
    "qwen3_vl_moe_text": dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[6, 5, 5],
                                                   mrope_interleaved=True)),
    "qwen2_5_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3])),
    # GLM-4.5V's q, k and v biases; Megatron-Bridge's GLM-4.5V bridge reads the text config's head_dim and
    # use_qk_norm, which transformers 5.12.1's config derives or lacks
    "glm4v_moe_text": dict(attention_bias=True, head_dim=16, use_qk_norm=False,
                           rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                                mrope_section=[2, 1, 1])),
}
# The image processor each VLM's Hugging Face folder holds, sized to its tiny vision tower (by model type)
IMAGE_PROCESSORS = {
    "qwen3_vl": ("Qwen2VLImageProcessorPil", dict(patch_size=8, temporal_patch_size=2, merge_size=2)),
    "qwen3_vl_moe": ("Qwen2VLImageProcessorPil", dict(patch_size=8, temporal_patch_size=2, merge_size=2)),
    "qwen2_5_vl": ("Qwen2VLImageProcessorPil", dict(patch_size=8, temporal_patch_size=2, merge_size=2)),
    "glm4v_moe": ("Glm4vImageProcessorPil", dict(patch_size=8, temporal_patch_size=2, merge_size=2)),
    "mistral3": ("PixtralImageProcessorPil", dict(patch_size=8)),
}
# The tiny vision towers (by model type, less an `_moe` suffix)
VISION = {
    "qwen3_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                     temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                     deepstack_visual_indexes=[0]),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=64, window_size=32, fullatt_block_indexes=[1]),
    "mistral3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                     image_size=32, patch_size=8),
    "glm4v": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, image_size=32,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64),
}


def tiny(defaults: dict, mtp: int) -> dict:
    """The fields of TINY and LAYER_KINDS that a config with these defaults has."""
    fields = {name: value for name, value in TINY.items() if name in defaults}
    fields.update(MODEL_FIELDS.get(defaults["model_type"], {}))
    for name, kinds in LAYER_KINDS.items():
        if name in defaults:  # a model of one kind of layer stays so (Qwen's full attention)
            fields[name] = kinds if len(set(defaults[name])) > 1 else defaults[name][:1] * TINY["num_hidden_layers"]
    if defaults["model_type"] in MTP_MODEL_TYPES:
        # said either way: transformers 5.25's DeepSeek-V3 and GLM-4.5 configs take a missing field for 1
        fields["num_nextn_predict_layers"] = mtp
    if "kv_lora_rank" in defaults:
        # multi-latent attention: a query/key head is its no-rope part and its rope part; every
        # head its own key and value
        fields.update(num_key_value_heads=TINY["num_attention_heads"], head_dim=TINY["qk_rope_head_dim"],
                      qk_head_dim=TINY["qk_nope_head_dim"] + TINY["qk_rope_head_dim"])
    return fields


def hf_config_fields(arch: str, args: argparse.Namespace) -> dict:
    """The tiny config of `arch`: the keyword arguments of its transformers config class."""
    import transformers

    defaults = getattr(transformers, arch).config_class().to_dict()
    fields = {} if args.tied is None else dict(tie_word_embeddings=args.tied)  # else the architecture's own
    if "text_config" in defaults:  # a VLM
        vision = VISION[defaults["model_type"].removesuffix("_moe")]
        # both levels say the same: transformers 5.12.1's Mistral3 config defaults to tied at the top
        # and untied in its text config, and the model 5.25 builds of it ties by the top level
        fields.setdefault("tie_word_embeddings", defaults["text_config"].get("tie_word_embeddings", False))
        return dict(fields, text_config=tiny(defaults["text_config"], args.mtp), vision_config=vision)
    return dict(tiny(defaults, args.mtp), **fields)


def build_hf_model(arch: str, args: argparse.Namespace):
    """The tiny Hugging Face model of `arch`, every tensor of its state dict distinct random values
    (norm weights and biases too: noise added to transformers' initialisation), in float32."""
    import transformers

    model_class = getattr(transformers, arch)
    config = model_class.config_class(**hf_config_fields(arch, args), architectures=[arch])
    torch.manual_seed(SEED)
    model = model_class(config).float().eval()
    generator = torch.Generator().manual_seed(SEED)
    seen = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point() or tensor.data_ptr() in seen:
                continue  # a tied weight: noised once, through its first name
            seen[tensor.data_ptr()] = name
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
            if args.dtype == "bfloat16":  # the checkpoint's values, which the logits are computed from
                tensor.copy_(tensor.to(torch.bfloat16))
    state = model.state_dict()
    assert_distinct({name: state[name] for name in seen.values()})
    return model


def assert_distinct(tensors: dict) -> None:
    """That no two of `tensors` hold the same values, so that an export that swaps two is caught."""
    by_values = {}
    for name, tensor in tensors.items():
        key = (tuple(tensor.shape), tensor.float().sum().item())
        other = by_values.setdefault(key, name)
        assert other == name or not torch.equal(tensor, tensors[other]), f"{name} equals {other}"


def add_mtp_layers(hf_dir: str, config, mtp: int, dtype: torch.dtype) -> None:
    """Multi-token-prediction layers in the Hugging Face checkpoint, which transformers' model does not
    build: as DeepSeek-V3 and GLM-4.5 checkpoints hold them, `model.layers.<num_hidden_layers + i>.*`,
    a decoder layer like the last one, and its `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`,
    each distinct random values."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(file)
    last = config.num_hidden_layers - 1
    generator = torch.Generator().manual_seed(SEED + 1)
    hidden = config.hidden_size
    for i in range(mtp):
        prefix = f"model.layers.{config.num_hidden_layers + i}."
        layer = {prefix + name[len(f"model.layers.{last}."):]: tensor.shape for name, tensor in tensors.items()
                 if name.startswith(f"model.layers.{last}.")}
        layer.update({prefix + "enorm.weight": (hidden,), prefix + "hnorm.weight": (hidden,),
                      prefix + "shared_head.norm.weight": (hidden,), prefix + "eh_proj.weight": (hidden, 2 * hidden)})
        for name, shape in layer.items():
            noise = torch.randn(shape, generator=generator) * 0.05
            tensors[name] = (noise + 1 if name.endswith("norm.weight") else noise).to(dtype)
    save_file(tensors, file, metadata={"format": "pt"})


def original_logits(model) -> torch.Tensor:
    """The Hugging Face model's float32 logits on PROMPT_IDS (text only)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT_IDS), use_cache=False).logits.float().contiguous()


# --- CPU stand-ins ---------------------------------------------------------------------------


def install_cpu_stand_ins() -> None:
    """Replace the few CUDA-only calls on the save path; none touches a weight."""
    # Megatron's checkpoint strategies synchronise the device around a save: nothing to wait for on the CPU.
    torch.cuda.synchronize = lambda *a, **k: None
    # Megatron places its small bookkeeping tensors (the save's failure flags) on the current device.
    torch.cuda.current_device = lambda: "cpu"
    # `save_megatron_model` records the CUDA generator's state beside the CPU one (in `rng_state`,
    # a pickled object): the CPU generator's state stands in for it.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()


def local_te_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, multi_latent_attention=False,
                  qk_l2_norm=False, **_):
    """`get_gpt_layer_with_transformer_engine_spec`, answered with Megatron-Core's local spec of the
    same layer (the TE-only options, fusers and FP8, have no local counterpart). Without apex the
    local norms follow `config.normalization`, as TENorm does."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                    qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention,
                                    qk_l2_norm=qk_l2_norm)


def use_local_specs() -> None:
    """Megatron-Bridge's providers ask for TransformerEngine's layer specs (CUDA only) by default,
    and some build on them unconditionally (OLMoE's and MiniMax-M2's attention, ERNIE 4.5's block,
    every multi-token-prediction block, Qwen3-VL's language and vision layers and its patch merger):
    wherever a module holds `get_gpt_layer_with_transformer_engine_spec` or
    `get_vit_layer_with_transformer_engine_spec`, it gets the local spec of the same layer; Megatron-
    Core's block, layer-list and MTP spec builders are asked for the local backend whatever the
    caller says; and Qwen3-VL's patch merger gets Megatron-Core's local norm and linears. The local
    modules hold the same parameters under the names Megatron-Bridge maps."""
    import functools
    import inspect

    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qwen3_vl_model
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def local_backend(build):
        signature = inspect.signature(build)

        @functools.wraps(build)
        def build_local(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.arguments["use_transformer_engine"] = False
            return build(*bound.args, **bound.kwargs)

        return build_local

    swaps = {
        id(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec): local_te_spec,
        id(vit_layer_specs.get_vit_layer_with_transformer_engine_spec): vit_layer_specs.get_vit_layer_with_local_spec,
    }
    for build in (gpt_layer_specs.get_gpt_decoder_block_spec, gpt_layer_specs.get_gpt_decoder_layer_specs,
                  gpt_layer_specs.get_gpt_mtp_block_spec):
        swaps[id(build)] = local_backend(build)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            for attribute, value in list(vars(module).items()):
                if id(value) in swaps:
                    setattr(module, attribute, swaps[id(value)])
    qwen3_vl_model.TENorm = WrappedTorchNorm
    qwen3_vl_model.TEColumnParallelLinear, qwen3_vl_model.TERowParallelLinear = ColumnParallelLinear, RowParallelLinear


def with_local_expert_mappings(bridge_class) -> None:
    """Give a model bridge's mapping registry the names of SequentialMLP's experts, which the local
    spec builds (`mlp.experts.local_experts.<e>.linear_fcN.weight`), beside TransformerEngine's
    grouped ones (`mlp.experts.linear_fcN.weight<e>`), for the bridges that map only the latter
    (GLM-4.5, DeepSeek, ...): each twin is the bridge's own mapping, with the same transform, under the
    local name, as Megatron-Bridge's Qwen3-MoE and Qwen3.5 bridges write them."""
    import copy
    import re

    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    original = bridge_class.mapping_registry
    if getattr(original, "adds_local_experts", False):
        return

    def mapping_registry(self):
        registry = original(self)
        names = {mapping.megatron_param for mapping in registry.mappings}
        twins = []
        for mapping in registry.mappings:
            grouped = re.fullmatch(r"(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)\*", mapping.megatron_param)
            local = grouped and f"{grouped[1]}.local_experts.*.{grouped[2]}.{grouped[3]}"
            if local and local not in names:
                twin = copy.copy(mapping)
                twin.megatron_param = local
                twins.append(twin)
        return MegatronMappingRegistry(*registry.mappings, *twins) if twins else registry

    mapping_registry.adds_local_experts = True
    bridge_class.mapping_registry = mapping_registry


def local_attention_for_mla() -> None:
    """Megatron-Core's multi-latent attention passes its core attention the query/key and value
    head sizes (`k_channels`, `v_channels`), which TransformerEngine's attention takes and the local
    `DotProductAttention` refuses: the local backend's core attention drops them. It holds no
    weights, and no forward pass runs here."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentDotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    LocalSpecProvider.core_attention = lambda self: LatentDotProductAttention


def zero_centered_torch_norm() -> None:
    """Megatron-Core's torch norm (the local spec's, without apex or TE) refuses a zero-centred
    gamma (Gemma's RMSNorm and Nemotron's LayerNorm scale by 1 + weight, and keep `weight` as
    Hugging Face does). Here it builds torch's norm of the config's kind scaling by 1 + weight: the
    same parameters, names and shapes."""
    from megatron.core.transformer import torch_norm

    class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
        def forward(self, x):
            return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)

    class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)

    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.layernorm_zero_centered_gamma:
            return build(cls, config, hidden_size, eps, **kwargs)
        norm = ZeroCenteredRMSNorm if config.normalization == "RMSNorm" else ZeroCenteredLayerNorm
        return norm(normalized_shape=hidden_size, eps=eps)

    torch_norm.WrappedTorchNorm.__new__ = new


class LinearForLastLayer(torch.nn.Linear):
    """verl's critic head (`verl/models/mcore/bridge.py`'s `make_value_model`): a replicated
    hidden -> 1 linear in place of GPTModel's output layer, which Megatron-Bridge maps as
    replicated under the class's name."""

    def __init__(self, hidden: int):
        super().__init__(hidden, 1, bias=False)
        self.sequence_parallel = False

    def forward(self, input_, weight=None, runtime_gather_output=None):
        return super().forward(input_).float(), None


def value_head_weight(hidden: int) -> torch.Tensor:
    """The critic's value head: distinct random values, the same in every rank and in the reference."""
    return torch.randn(1, hidden, generator=torch.Generator().manual_seed(SEED + 2)) * 0.02


def with_value_head(model: list) -> list:
    """verl's pre-wrap hook for a critic: the last stage's output layer becomes the value head
    (registered after Megatron-Bridge's weight loading, as verl registers it)."""
    for chunk in model:
        if chunk.post_process:
            chunk.output_layer = LinearForLastLayer(chunk.config.hidden_size).to(chunk.config.params_dtype)
            with torch.no_grad():
                chunk.output_layer.weight.copy_(value_head_weight(chunk.config.hidden_size))
    return model


# --- one rank --------------------------------------------------------------------------------


def run_rank(rank: int, args: argparse.Namespace, world: int, rendezvous: str, hf_dir: str) -> None:
    """One gloo rank: Megatron's parallel state, Megatron-Bridge's model, the save and the references."""
    from megatron_save import join_gloo

    join_gloo(rank, world, rendezvous, RANK_TIMEOUT_S)
    install_cpu_stand_ins()
    build_and_save(args, hf_dir)
    dist.barrier()
    dist.destroy_process_group()


def cpu_provider(bridge, args: argparse.Namespace):
    """Megatron-Bridge's provider of the model, loading the Hugging Face weights, with the CPU
    settings: none of them changes a parameter's name, shape or sharding."""
    from megatron.bridge.models import gpt_provider
    from megatron.core.transformer.enums import AttnBackend

    with_local_expert_mappings(type(bridge._model_bridge))
    provider = bridge.to_megatron_provider(load_weights=True)
    # Megatron-Core's own modules, not TransformerEngine's (CUDA only): see `use_local_specs` for
    # the specs the bridges build on TE's.
    if provider.transformer_layer_spec in (gpt_provider.default_layer_spec, gpt_provider.transformer_engine_layer_spec):
        provider.transformer_layer_spec = gpt_provider.local_layer_spec
    provider.attention_backend = AttnBackend.local
    # CUDA kernels (apex, TE, Triton) and CUDA streams.
    for flag in ("masked_softmax_fusion", "persist_layer_norm", "bias_activation_fusion", "bias_dropout_fusion",
                 "apply_rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion",
                 "moe_shared_expert_overlap", "moe_permute_fusion", "moe_router_fusion"):
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    # The all-to-all dispatcher copies its split sizes to the host on a side CUDA stream.
    provider.moe_token_dispatcher_type = "allgather"
    provider.params_dtype = provider.pipeline_dtype = getattr(torch, args.dtype)
    provider.bf16, provider.fp16 = args.dtype == "bfloat16", False
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = args.tp, args.pp
    provider.expert_model_parallel_size, provider.expert_tensor_parallel_size = args.ep, args.etp
    provider.virtual_pipeline_model_parallel_size = args.vpp
    provider.num_layers_in_first_pipeline_stage = args.first_stage_layers
    provider.num_layers_in_last_pipeline_stage = args.last_stage_layers
    provider.sequence_parallel = False
    if args.pad_vocab:
        # Megatron pads the vocabulary to a multiple of 128 x TP, as Megatron-Bridge's training
        # setup asks when the vocabulary comes from a tokenizer; from a Hugging Face model it keeps
        # the model's own size. Its loader pads only tensor-parallel embeddings (`parse` checks TP).
        provider.should_pad_vocab, provider.make_vocab_size_divisible_by = True, 128
    if args.value_head:
        from megatron.bridge.models.conversion.param_mapping import AutoMapping

        AutoMapping.register_module_type("LinearForLastLayer", "replicated")
        provider.register_pre_wrap_hook(with_value_head)
    provider.finalize()
    return provider


def build_and_save(args: argparse.Namespace, hf_dir: str) -> None:
    """Megatron-Bridge's model of the Hugging Face folder on this rank, saved, and from rank 0 its
    export (every rank takes part in gathering it)."""
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp,
        virtual_pipeline_model_parallel_size=args.vpp,
    )
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = cpu_provider(bridge, args)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    exported = {}
    for name, tensor in bridge.export_hf_weights(model, cpu=True, show_progress=False):
        if dist.get_rank() == 0:
            exported[name] = tensor.detach().clone().contiguous()
    if args.layout == "megatron-lm":
        bridge.save_megatron_model(model, args.out)
    else:
        save_like_verl(model, checkpoint_dir(args))
    if dist.get_rank() == 0:
        write_references(args, exported)


def save_like_verl(model: list, directory: str) -> None:
    """The model's sharded state dict (`model`, or `model0`, `model1`... per virtual pipeline stage) and
    the RNG states, saved as verl's `MegatronCheckpointManager` does: `dist_checkpointing.save` with the
    torch_dist strategy, fully parallel over the data-parallel ranks."""
    import random

    import numpy as np
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    state = {}
    for stage, chunk in enumerate(model):
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(stage)
        state[f"model{stage}" if len(model) > 1 else "model"] = chunk.sharded_state_dict()
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(),
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    state["rng_state"] = ShardedObject(
        "rng_state", [rng],
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    os.makedirs(directory, exist_ok=True)
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    dist_checkpointing.save(state, directory, sharded_strategy=strategy, validate_access_integrity=True)


def checkpoint_dir(args: argparse.Namespace) -> str:
    """Where the torch_dist files are."""
    if args.layout == "verl":
        return os.path.join(args.out, "model", "dist_ckpt")
    return os.path.join(args.out, "iter_0000000")


def hf_config_dir(args: argparse.Namespace) -> str:
    """Where the Hugging Face config (and processor files) go beside the checkpoint."""
    return os.path.join(args.out, "model", "huggingface") if args.layout == "verl" else os.path.join(args.out, "hf")


def write_references(args: argparse.Namespace, exported: dict) -> None:
    """Megatron-Bridge's export and the saved keys, into `DIR/reference/`."""
    from megatron_save import describe_checkpoint
    from safetensors.torch import save_file

    reference = os.path.join(args.out, "reference")
    os.makedirs(reference, exist_ok=True)
    save_file(exported, os.path.join(reference, "bridge.safetensors"))
    with open(os.path.join(reference, "keys.json"), "w") as f:
        json.dump(describe_checkpoint(checkpoint_dir(args)), f, indent=1)


def world_size(args: argparse.Namespace) -> int:
    """The fewest gloo ranks the parallel sizes take: tp * pp * dp, where Megatron draws the expert
    ranks (ep * etp) from tp * dp."""
    import math

    return args.pp * math.lcm(args.tp, args.ep * args.etp)


def parse(argv: list[str]) -> argparse.Namespace:
    """One checkpoint's arguments, checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", required=True)
    for size in ("tp", "pp", "ep", "etp"):
        parser.add_argument(f"--{size}", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--first-stage-layers", type=int, default=None)
    parser.add_argument("--last-stage-layers", type=int, default=None)
    parser.add_argument("--layout", choices=["verl", "megatron-lm"], default="verl")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--mtp", type=int, default=0)
    tying = parser.add_mutually_exclusive_group()
    tying.add_argument("--tied", dest="tied", action="store_true")
    tying.add_argument("--untied", dest="tied", action="store_false")
    parser.set_defaults(tied=None)
    parser.add_argument("--value-head", action="store_true")
    parser.add_argument("--pad-vocab", action="store_true")
    args = parser.parse_args(argv)
    world = world_size(args)
    if world > MAX_RANKS:
        parser.error(f"pp * lcm(tp, ep * etp) is {world}; at most {MAX_RANKS} ranks")
    if args.pad_vocab and args.tp == 1:
        parser.error("--pad-vocab takes --tp 2 or more: Megatron-Bridge pads only a tensor-parallel embedding")
    if (args.vpp or args.first_stage_layers or args.last_stage_layers) and args.pp == 1:
        parser.error("--vpp, --first-stage-layers and --last-stage-layers split pipeline stages: "
                     "they take --pp 2 or more")
    if args.value_head and (not args.arch.endswith("ForCausalLM") or args.tied):
        parser.error("--value-head replaces the LM head of an untied causal model (--untied)")
    return args


def write(args: argparse.Namespace) -> None:
    """One checkpoint: the Hugging Face model (and with `--value-head` its critic), saved on gloo ranks
    forked from this process, then the references checked and completed."""
    import shutil

    from safetensors.torch import save_file

    model = build_hf_model(args.arch, args)
    reference_model = critic_of(model) if args.value_head else model
    logits = original_logits(reference_model)
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    shutil.rmtree(args.out, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="megatron-bridge-ranks-") as scratch:
        hf_dir = os.path.join(scratch, "hf")
        model.save_pretrained(hf_dir)
        if model.config.model_type in IMAGE_PROCESSORS:
            import transformers

            name, fields = IMAGE_PROCESSORS[model.config.model_type]
            getattr(transformers, name)(**fields).save_pretrained(hf_dir)
        if args.mtp:
            add_mtp_layers(hf_dir, model.config.get_text_config(), args.mtp, model.dtype)
        mp.start_processes(run_rank, args=(args, world_size(args), os.path.join(scratch, "rendezvous"), hf_dir),
                           nprocs=world_size(args), start_method="fork")
        copy_hf_config(hf_dir, hf_config_dir(args))
        if args.value_head:  # the critic's config in place of the actor's
            os.remove(os.path.join(hf_config_dir(args), "generation_config.json"))
            reference_model.config.save_pretrained(hf_config_dir(args))
        check_export(model, hf_dir, os.path.join(args.out, "reference"), args.value_head)
    save_file({"logits": logits}, os.path.join(args.out, "reference", "logits.safetensors"))


def critic_of(model):
    """verl's critic of the causal model as Hugging Face holds it: `<Model>ForTokenClassification` with
    one label, the causal model's weights but its LM head, `score.weight` the critic's value head, and
    `score.bias` (which transformers' head has and verl's has not) zero."""
    import transformers

    config = model.config.__class__(**model.config.to_dict())
    config.architectures = [model.config.architectures[0].replace("ForCausalLM", "ForTokenClassification")]
    config.num_labels = 1
    critic = getattr(transformers, config.architectures[0])(config).float().eval()
    state = {name: tensor for name, tensor in model.state_dict().items() if name.startswith("model.")}
    head = {"score.weight": value_head_weight(config.hidden_size), "score.bias": torch.zeros(1)}
    critic.load_state_dict(dict(state, **head), strict=True)
    return critic


def check_export(model, hf_dir: str, reference: str, value_head: bool) -> None:
    """That Megatron's model held the Hugging Face model's weights: each tensor of Megatron-Bridge's
    export of it (`reference/bridge.safetensors`) equals the Hugging Face model's tensor of that name,
    as transformers keeps it in memory or as `save_pretrained` wrote it, and every tensor of one of
    those two is exported.

    Megatron-Bridge exports a vocabulary Megatron padded (`--pad-vocab`, and Gemma 4's provider
    pads its own) with the padding rows; the reference keeps the model's own rows, and `keys.json`
    records each tensor cut (`bridge_padded_rows`: name -> [exported rows, kept rows]). A critic's
    value head, which Megatron-Bridge exports as the LM head (`lm_head.weight`, one row), is the
    reference's `score.weight`, as the critic's Hugging Face model names it."""
    from safetensors.torch import load_file, save_file

    exported = load_file(os.path.join(reference, "bridge.safetensors"))
    in_memory = model.state_dict()
    on_disk = {}
    for file in sorted(os.listdir(hf_dir)):
        if file.endswith(".safetensors"):
            on_disk.update(load_file(os.path.join(hf_dir, file)))
    if value_head:
        score = exported.pop("lm_head.weight")
        assert torch.equal(score, value_head_weight(score.shape[1]).to(score.dtype)), "the value head was not exported"
        in_memory, on_disk = (dict(tensors) for tensors in (in_memory, on_disk))
        del in_memory["lm_head.weight"], on_disk["lm_head.weight"]
    padded = {}
    for name, tensor in exported.items():
        expected = on_disk.get(name, in_memory.get(name))
        if expected is not None and tensor.shape[1:] == expected.shape[1:] and tensor.shape[0] > expected.shape[0]:
            padded[name] = [tensor.shape[0], expected.shape[0]]
            exported[name] = tensor = tensor[: expected.shape[0]].contiguous()
        if expected is None or not torch.equal(tensor, expected.to(tensor.dtype)):
            raise AssertionError(f"Megatron-Bridge exported {name} {tuple(tensor.shape)}, which the Hugging Face model "
                                 f"does not hold ({None if expected is None else tuple(expected.shape)})")
    if not (set(on_disk) <= set(exported) or set(in_memory) <= set(exported)):
        raise AssertionError(f"Megatron-Bridge did not export {sorted(set(on_disk) - set(exported))}")
    if value_head:
        exported["score.weight"] = score
    if padded or value_head:
        save_file(exported, os.path.join(reference, "bridge.safetensors"))
    if padded:
        with open(os.path.join(reference, "keys.json")) as f:
            keys = json.load(f)
        with open(os.path.join(reference, "keys.json"), "w") as f:
            json.dump(dict(keys, bridge_padded_rows=padded), f, indent=1)


def copy_hf_config(hf_dir: str, folder: str) -> None:
    """The Hugging Face folder's files but its weights."""
    import shutil

    shutil.copytree(hf_dir, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))


def import_megatron_bridge() -> None:
    """Import what the ranks run, before they are forked, and put the stand-ins in place."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from megatron_bridge_imports import import_megatron_bridge as imported

    imported()
    import megatron.bridge.models  # noqa: F401
    import megatron.bridge.training.model_load_save  # noqa: F401  (save_megatron_model's)
    import megatron.core.dist_checkpointing  # noqa: F401
    import transformers  # noqa: F401

    use_local_specs()
    local_attention_for_mla()
    zero_centered_torch_norm()
    # Megatron-Core's torch_dist writer collects its results through one queue per process, served
    # by a `multiprocessing` manager it spawns on first use (3 s, a fresh interpreter); made here
    # once, the ranks forked for every checkpoint inherit it instead of spawning their own.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.get_write_results_queue()


def main() -> None:
    """One checkpoint from the command line's arguments, or with `--batch FILE`, every one that
    FILE (JSON: a list of argument lists) names, one after another in this process."""
    argv = sys.argv[1:]
    batches = [parse(arguments) for arguments in json.load(open(argv[1]))] if argv[:1] == ["--batch"] else [parse(argv)]
    import_megatron_bridge()
    for args in batches:
        start = time.monotonic()
        write(args)
        print(f"saved {args.out} in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
