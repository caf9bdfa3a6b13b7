"""A Megatron-Core torch_dist checkpoint of Qwen3-235B-A22B's size whose tensor bytes are holes:
every file and record as Megatron-Core's save lays them out (verl's `actor/dist_ckpt/` with
`actor/huggingface/config.json`), 470 GB of `.distcp` files that take a few MB of disk.

Layout: pipeline parallel PP stages times expert parallel EP ranks, tensor parallel 1, as a
Qwen3-MoE run of that size trains. Megatron-Core saves each layer of a stacked tensor as a chunk
of its own (offset on the layer axis), and each expert of each layer too; a tensor that every
expert-parallel rank of a stage holds is saved once, by the stage's first rank. Global rank
`stage * EP + expert_rank` writes `__{rank}_0.distcp`.

Each chunk is a `torch.save` record as DCP's FileSystemWriter writes it into a `.distcp` file:
a zip of `archive/data.pkl` (torch's own pickle of `_rebuild_tensor_v2`) and `archive/data/0`,
stored, the tensor's bytes. Those bytes are skipped with a seek, so the file system keeps them as
a hole; the record's CRC of them is left 0, which no reader here checks (the data is never
unzipped, only located). `.metadata` is built with torch's own DCP metadata classes.
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import struct
import zlib

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

# Qwen3-235B-A22B's config.json, as published (Qwen/Qwen3-235B-A22B).
QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
TORCH_DIST = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_END_OF_DIRECTORY = struct.Struct("<IHHHHIIH")


def megatron_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Megatron-Core's stacked tensors of a Qwen3-MoE model (local layer spec), with their global shapes."""
    layers, hidden, experts = config["num_hidden_layers"], config["hidden_size"], config["num_experts"]
    heads, groups, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    ffn, vocab = config["moe_intermediate_size"], config["vocab_size"]
    attention = "decoder.layers.self_attention."
    return {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "output_layer.weight": (vocab, hidden),
        "decoder.final_layernorm.weight": (hidden,),
        attention + "linear_qkv.layer_norm_weight": (layers, hidden),
        attention + "linear_qkv.weight": (layers, (heads + 2 * groups) * head_dim, hidden),
        attention + "linear_proj.weight": (layers, hidden, heads * head_dim),
        attention + "q_layernorm.weight": (layers, head_dim),
        attention + "k_layernorm.weight": (layers, head_dim),
        "decoder.layers.pre_mlp_layernorm.weight": (layers, hidden),
        "decoder.layers.mlp.router.weight": (layers, experts, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (layers, experts, 2 * ffn, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (layers, experts, hidden, ffn),
    }


def stage_layers(layers: int, stages: int) -> list[range]:
    """Each pipeline stage's layers, the earlier stages one more where they do not divide."""
    sizes = [layers // stages + (stage < layers % stages) for stage in range(stages)]
    starts = [sum(sizes[:stage]) for stage in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def chunk_placement(config: dict, stages: int, expert_ranks: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """Every saved chunk, as (tensor, offset, sizes, writing rank), in the order each rank writes them."""
    shapes = megatron_tensors(config)
    experts = config["num_experts"]
    per_rank = experts // expert_ranks
    placed = []
    for stage, layers in enumerate(stage_layers(config["num_hidden_layers"], stages)):
        first = stage * expert_ranks
        if stage == 0:
            placed.append(("embedding.word_embeddings.weight", (0, 0), shapes["embedding.word_embeddings.weight"], first))
        if stage == stages - 1:
            for name in ("decoder.final_layernorm.weight", "output_layer.weight"):
                placed.append((name, (0,) * len(shapes[name]), shapes[name], first))
        for layer in layers:
            for name, shape in shapes.items():
                if not name.startswith("decoder.layers."):
                    continue
                if ".experts." not in name:
                    placed.append((name, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]), first))
                    continue
                for rank in range(expert_ranks):
                    for expert in range(rank * per_rank, (rank + 1) * per_rank):
                        placed.append((name, (layer, expert, 0, 0), (1, 1, *shape[2:]), first + rank))
    return placed


class _Storage:
    """The persistent id torch.save gives a tensor's storage."""

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype, self.numel = dtype, numel


class _TensorRecord:
    """Pickles as torch.save pickles a contiguous tensor: `_rebuild_tensor_v2` of storage '0'."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = _Storage(dtype, math.prod(shape)), shape

    def __reduce__(self):
        strides = tuple(math.prod(self.shape[axis + 1:]) for axis in range(len(self.shape)))
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, self.shape, strides, False, collections.OrderedDict())


class _RecordPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            storage_class = getattr(torch, {torch.bfloat16: "BFloat16Storage", torch.float32: "FloatStorage"}[obj.dtype])
            return ("storage", storage_class, "0", "cpu", obj.numel)
        return None


def write_record(handle, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """One chunk's torch.save record at the handle's position, its tensor bytes a hole."""
    data = io.BytesIO()
    _RecordPickler(data, protocol=2).dump(_TensorRecord(dtype, shape))
    pickled = data.getvalue()
    nbytes = math.prod(shape) * dtype.itemsize
    start = handle.tell()
    members = [("archive/data.pkl", pickled, zlib.crc32(pickled), len(pickled)), ("archive/data/0", None, 0, nbytes)]
    directory = []
    for name, content, crc, size in members:
        offset = handle.tell() - start
        encoded = name.encode()
        handle.write(_LOCAL_HEADER.pack(0x04034B50, 20, 0, 0, 0, 0x21, crc, size, size, len(encoded), 0) + encoded)
        if content is None:
            handle.seek(size, os.SEEK_CUR)  # the tensor's bytes: a hole
        else:
            handle.write(content)
        directory.append(_CENTRAL_HEADER.pack(0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, size, size, len(encoded), 0, 0, 0, 0, 0, offset) + encoded)
    directory_offset = handle.tell() - start
    handle.write(b"".join(directory))
    handle.write(_END_OF_DIRECTORY.pack(0x06054B50, 0, 0, len(members), len(members), sum(map(len, directory)), directory_offset, 0))


def write_sparse_checkpoint(actor: str, config: dict = QWEN3_235B_A22B, stages: int = 4, expert_ranks: int = 8) -> int:
    """The checkpoint under `actor` (verl's layout: `dist_ckpt/`, `huggingface/config.json`); the
    bytes of its tensors (what the files would hold, were they not holes)."""
    folder = os.path.join(actor, "dist_ckpt")
    shapes = megatron_tensors(config)
    total = write_sparse_dcp(folder, shapes, chunk_placement(config, stages, expert_ranks))
    with open(os.path.join(folder, "metadata.json"), "w") as handle:
        json.dump(TORCH_DIST, handle)  # Megatron-Core writes it last
    os.makedirs(os.path.join(actor, "huggingface"))
    with open(os.path.join(actor, "huggingface", "config.json"), "w") as handle:
        json.dump(config, handle, indent=1)
    return total


def write_sparse_dcp(
    folder: str, shapes: dict[str, tuple[int, ...]], placed: list[tuple[str, tuple[int, ...], tuple[int, ...], int]],
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """A DCP checkpoint in `folder` of tensors of `shapes` saved as the chunks `placed` ((tensor,
    offset, sizes, writing rank), in each rank's order), their bytes holes, and its `.metadata`
    made with torch's own classes; returns the tensors' bytes."""
    os.makedirs(folder)
    chunks: dict[str, list[ChunkStorageMetadata]] = {name: [] for name in shapes}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    by_rank: dict[int, list] = {}
    for name, offset, sizes, rank in placed:
        by_rank.setdefault(rank, []).append((name, offset, sizes))
    for rank, chunks_of_rank in sorted(by_rank.items()):
        file = f"__{rank}_0.distcp"
        with open(os.path.join(folder, file), "wb") as handle:
            for name, offset, sizes in chunks_of_rank:
                start = handle.tell()
                write_record(handle, dtype, sizes)
                chunks[name].append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes)))
                storage[MetadataIndex(name, torch.Size(offset))] = _StorageInfo(file, start, handle.tell() - start)
    entries = {
        name: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks[name])
        for name, shape in shapes.items()
    }
    with open(os.path.join(folder, ".metadata"), "wb") as handle:
        pickle.dump(Metadata(state_dict_metadata=entries, storage_data=storage), handle)
    return sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize


# Llama 3.3 70B Instruct's config.json, as published (meta-llama/Llama-3.3-70B-Instruct).
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}


def llama_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """A Llama model's state dict as transformers names it, with each tensor's shape."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, groups, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update({
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": (groups * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": (groups * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
        })
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return shapes


def fsdp_placement(shapes: dict[str, tuple[int, ...]], world_size: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """FSDP2's chunks: every tensor cut on its first dimension by torch.chunk's rule over the
    ranks (the last ones hold less, or nothing), each rank writing its own rows of every tensor."""
    placed = []
    for rank in range(world_size):
        for name, shape in shapes.items():
            rows = -(-shape[0] // world_size)
            start, stop = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
            if stop > start:
                placed.append((name, (start,) + (0,) * (len(shape) - 1), (stop - start, *shape[1:]), rank))
    return placed


def write_sparse_fsdp_dcp(folder: str, config: dict = LLAMA3_70B, world_size: int = 64) -> int:
    """A DCP save of `config`'s model by `world_size` FSDP2 ranks, flat at the top level of the
    state dict, its bytes holes, its config in `huggingface/`; returns the tensors' bytes."""
    total = write_sparse_dcp(folder, llama_tensors(config), fsdp_placement(llama_tensors(config), world_size))
    os.makedirs(os.path.join(folder, "huggingface"))
    with open(os.path.join(folder, "huggingface", "config.json"), "w") as handle:
        json.dump(config, handle, indent=1)
    return total
