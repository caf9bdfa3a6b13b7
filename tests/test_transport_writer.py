"""rayexport.transport.writer: streamed shards are byte-identical to safetensors' own save."""

import hashlib
import json

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save as safetensors_save

from rayexport.common.errors import ExportError
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import plan_shard_files
from rayexport.storage.store import Store
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE as INDEX_NAME

from rayexport.transport.writer import write_index, write_shards


def mixed_tensors():
    generator = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 5, generator=generator),
        "model.embed_tokens.weight": torch.randn(9, 4, generator=generator).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(4, generator=generator).to(torch.float16),
        "model.position_ids": torch.arange(7, dtype=torch.int64),
        "model.attention_mask": torch.tensor([True, False, True, True, False]),
        "model.scale": torch.tensor(1.5),
        "model.empty": torch.zeros(0, 4),
        "model.layers.1.mlp.down_proj.weight": torch.randn(5, 6, generator=generator),
    }


def plans_for(tensors, dtypes=None):
    dtypes = dtypes or {}
    plans = {}
    for name, tensor in tensors.items():
        source = str(tensor.dtype).removeprefix("torch.")
        shape = tuple(tensor.shape)
        piece = Piece(0, name, (0,) * len(shape), shape, source)
        plans[name] = TensorPlan(name, name, shape, source, dtypes.get(name, source), (piece,))
    return plans


def chunked(tensor, rows):
    """A tensor as runs of `rows` rows, as a writer receives row-sharded pieces."""
    return list(tensor.split(rows)) if rows and tensor.dim() and tensor.shape[0] else [tensor]


def write(tmp_path, tensors, plans, max_shard_size, rows=None, sha256=False):
    shard_files, split = plan_shard_files(list(plans.values()), max_shard_size)
    store = Store(str(tmp_path / "out"))
    stream = ((name, chunked(tensors[name], rows)) for shard in shard_files for name in shard.tensors)
    seen = []
    written, digests = write_shards(store, shard_files, plans, stream, seen.append, sha256)
    index = write_index(store, split, sha256)
    return store, shard_files, written + ([index] if index else []), digests, seen


def test_several_shards_are_byte_identical_to_safetensors(tmp_path):
    tensors = mixed_tensors()
    plans = plans_for(tensors)
    store, shard_files, written, digests, seen = write(tmp_path, tensors, plans, max_shard_size=150)
    assert len(shard_files) >= 3
    for shard in shard_files:
        reference = safetensors_save({name: tensors[name] for name in shard.tensors}, metadata={"format": "pt"})
        assert store.read_bytes(shard.filename) == reference, shard.filename
    assert sum(seen) == sum(plan.nbytes for plan in plans.values())
    assert set(digests) == set(tensors)


def test_index_maps_every_tensor_with_the_total_size(tmp_path):
    tensors = mixed_tensors()
    plans = plans_for(tensors)
    store, shard_files, written, _, _ = write(tmp_path, tensors, plans, max_shard_size=150)
    index = json.loads(store.read_bytes(INDEX_NAME))
    expected_map = {name: shard.filename for shard in shard_files for name in shard.tensors}
    assert index["weight_map"] == expected_map
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert INDEX_NAME in [item.name for item in written]
    # what transformers reads back: every file in the map holds exactly the tensors mapped to it
    for filename in set(index["weight_map"].values()):
        loaded = load_file(store.path(filename))
        assert set(loaded) == {name for name, file in index["weight_map"].items() if file == filename}
        for name, value in loaded.items():
            assert torch.equal(value, tensors[name])


@pytest.mark.parametrize("sha256", [False, True])
def test_recorded_sizes_and_digests_match_the_files(tmp_path, sha256):
    """Each file's size and fast digest, each tensor's digest, and with `--sha256` each file's
    SHA-256 too, as `sha256sum` would print it."""
    tensors = mixed_tensors()
    plans = plans_for(tensors)
    store, shard_files, written, digests, _ = write(tmp_path, tensors, plans, max_shard_size=150, sha256=sha256)
    assert sorted(item.name for item in written) == sorted([shard.filename for shard in shard_files] + [INDEX_NAME])
    for item in written:
        data = store.read_bytes(item.name)
        assert item.size == len(data)
        assert item.digest == xxhash.xxh3_128(data).hexdigest()
        assert item.sha256 == (hashlib.sha256(data).hexdigest() if sha256 else None)
        assert ("sha256" in item.record()) == sha256
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert digests[name] == xxhash.xxh3_128(raw).hexdigest()


def test_single_file_has_no_index(tmp_path):
    tensors = mixed_tensors()
    plans = plans_for(tensors)
    store, shard_files, written, _, _ = write(tmp_path, tensors, plans, max_shard_size=1 << 20)
    assert [shard.filename for shard in shard_files] == ["model.safetensors"]
    assert [item.name for item in written] == ["model.safetensors"]
    assert store.read_bytes("model.safetensors") == safetensors_save(tensors, metadata={"format": "pt"})
    assert not store.exists(INDEX_NAME)


def test_floats_are_cast_to_the_planned_dtype(tmp_path):
    tensors = mixed_tensors()
    plans = plans_for(tensors, {name: "bfloat16" for name, t in tensors.items() if t.dtype == torch.float32 and t.dim()})
    store, _, _, _, _ = write(tmp_path, tensors, plans, max_shard_size=1 << 20)
    expected = {name: tensor.to(getattr(torch, plans[name].dtype)) for name, tensor in tensors.items()}
    assert expected["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert store.read_bytes("model.safetensors") == safetensors_save(expected, metadata={"format": "pt"})


def test_rows_streamed_in_chunks_give_the_same_bytes(tmp_path):
    tensors = mixed_tensors()
    plans = plans_for(tensors, {name: "bfloat16" for name, t in tensors.items() if t.dtype == torch.float32 and t.dim()})
    store, _, _, digests, _ = write(tmp_path, tensors, plans, max_shard_size=1 << 20, rows=2)
    expected = {name: tensor.to(getattr(torch, plans[name].dtype)) for name, tensor in tensors.items()}
    assert store.read_bytes("model.safetensors") == safetensors_save(expected, metadata={"format": "pt"})
    raw = expected["model.embed_tokens.weight"].reshape(-1).view(torch.uint8).numpy().tobytes()
    assert digests["model.embed_tokens.weight"] == xxhash.xxh3_128(raw).hexdigest()


def test_a_tensor_out_of_order_is_refused_and_not_published(tmp_path):
    tensors = mixed_tensors()
    plans = plans_for(tensors)
    shard_files, _ = plan_shard_files(list(plans.values()), 1 << 20)
    store = Store(str(tmp_path / "out"))
    names = list(shard_files[0].tensors)
    names[0], names[1] = names[1], names[0]
    with pytest.raises(ExportError, match="expected tensor"):
        write_shards(store, shard_files, plans, ((name, [tensors[name]]) for name in names))
    assert not store.exists("model.safetensors")
