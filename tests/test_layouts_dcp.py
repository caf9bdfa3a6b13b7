"""The DCP layout against real `torch.distributed.checkpoint.save` output of FSDP2 gloo ranks:
metadata, model-prefix detection, the chunks shared over the workers, read in place locally
and piece by piece from S3, and a worker's memory while it exports its share."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import shutil
import uuid

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader

from rayexport.common.errors import ExportError
from rayexport.common.scan import is_finite
from rayexport.layouts.dcp import find_dcp_checkpoint
from rayexport.layouts.dcp_chunks import DcpChunk, list_chunks, read_in_place, share_chunks, slot_chunks
from rayexport.layouts.dcp_metadata import DCP_METADATA, read_metadata
from rayexport.layouts.base import SourceSettings
from rayexport.layouts.registry import detect_layout, find_checkpoint, snapshot
from rayexport.orchestration.job import export
from rayexport.plan.pieces import Piece
from rayexport.storage.store import Store
from support.checkpoints import write_dcp_checkpoint
from support.helpers import BUCKET, upload
from support.models import sized_llama_config

MiB = 2**20
BUCKET_SIZE = 8 * MiB
# As tests/test_orchestration_workers.py allows a worker reading verl rank files: allocator slack, the writer
# thread's arena, Python objects.
HEADROOM = 40 * MiB

# The session's DCP checkpoints (conftest's `dcp_checkpoints`) these tests read: nested with an
# optimizer beside the model, flat, and nested deeper.
VARIANTS = ("tied", "flat", "app")


@pytest.fixture(scope="module")
def written(dcp_checkpoints):
    return dcp_checkpoints


def stored_entries(path: str) -> dict:
    return FileSystemReader(path).read_metadata().state_dict_metadata


def copy_checkpoint(source: str, destination) -> str:
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("huggingface"))
    return str(destination)


def read_shares(checkpoint, num_workers: int, aliases: dict[str, str] | None = None):
    """The checkpoint spread over `num_workers` workers as its layout spreads it, each part read
    here as its worker reads it: the `Loaded`, and what each pseudo-rank holds."""
    held = {}

    def load(parts):
        infos = {}
        for part in parts.values():
            for rank, tensors in checkpoint.read(part, "", lambda count: None).items():
                held[rank] = tensors
                infos[rank] = tensors.describe()
        return infos

    return checkpoint.share(num_workers, aliases or {}, load), held


def rebuild(held, reference) -> dict[str, torch.Tensor]:
    """Every tensor put together from the chunks the pseudo-ranks hold, at their offsets."""
    rebuilt = {key: torch.full_like(tensor, float("nan")) for key, tensor in reference.items()}
    for tensors in held.values():
        for key, info in tensors.describe().items():
            region = tuple(slice(start, start + size) for start, size in zip(info.offset, info.local_shape))
            rebuilt[key][region] = tensors[key]
    return rebuilt


def assert_one_line_naming(error: pytest.ExceptionInfo, uri: str) -> None:
    message = str(error.value)
    assert uri in message and "\n" not in message, message


@pytest.mark.parametrize("name", VARIANTS)
def test_metadata_gives_global_shapes_and_dtypes(written, name):
    checkpoint = find_dcp_checkpoint(Store(written[name].path))
    reference = written[name].reference
    assert set(checkpoint.tensors) == set(reference)
    for key, tensor in checkpoint.tensors.items():
        assert tensor.key == written[name].prefix + key
        assert tensor.shape == tuple(reference[key].shape), key
        assert tensor.dtype == "float32"
        assert tensor.nbytes == reference[key].nbytes


def test_rank_files_hold_uneven_fsdp2_shards(written):
    """World size 3 over a 1000-row embedding: FSDP2 pads to 334-row shards, and DCP records
    the unpadded chunks each rank really holds."""
    entry = stored_entries(written["flat"].path)["model.embed_tokens.weight"]
    chunks = sorted((tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks)
    assert chunks == [((0, 0), (334, 32)), ((334, 0), (334, 32)), ((668, 0), (332, 32))]
    assert sorted(name for name in os.listdir(written["flat"].path) if name.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
    ]


@pytest.mark.parametrize("name", VARIANTS)
def test_prefix_is_detected_and_training_state_skipped(written, name):
    store = Store(written[name].path)
    assert detect_layout(store).name == "dcp"
    checkpoint = find_dcp_checkpoint(store)
    assert checkpoint.prefix == written[name].prefix
    assert checkpoint.uri == store.uri
    entries = stored_entries(written[name].path)
    model_keys = sorted(tensor.key for tensor in checkpoint.tensors.values())
    assert sorted(model_keys + checkpoint.skipped) == sorted(entries)  # each stored key exactly once
    if written[name].with_optimizer:
        optimizer_root = written[name].prefix.replace("model.", "optim.")
        assert checkpoint.skipped and all(key.startswith(optimizer_root) for key in checkpoint.skipped)
        assert optimizer_root + "state.model.norm.weight.exp_avg" in checkpoint.skipped
        assert optimizer_root + "state.model.norm.weight.step" in checkpoint.skipped  # a 0-dim tensor
        assert optimizer_root + "param_groups.0.lr" in checkpoint.skipped  # not a tensor
    else:
        assert checkpoint.skipped == []


@pytest.mark.parametrize("name", VARIANTS)
def test_prefix_is_detected_from_keys_when_metadata_lacks_planner_data(written, name, tmp_path):
    """Checkpoints saved without the default planner's key paths: the keys alone decide."""
    metadata = FileSystemReader(written[name].path).read_metadata()
    assert metadata.planner_data  # what the default planner records, and this test removes
    for name_ in os.listdir(written[name].path):
        if name_.endswith(".distcp"):
            shutil.copy(os.path.join(written[name].path, name_), tmp_path)
    with open(tmp_path / DCP_METADATA, "wb") as handle:
        pickle.dump(dataclasses.replace(metadata, planner_data=None), handle)
    checkpoint = find_dcp_checkpoint(Store(str(tmp_path)))
    assert checkpoint.prefix == written[name].prefix
    assert set(checkpoint.tensors) == set(written[name].reference)


def test_explicit_prefix_overrides_detection(written):
    store = Store(written["tied"].path)
    assert find_dcp_checkpoint(store, prefix="model.") == find_dcp_checkpoint(store)
    as_stored = find_dcp_checkpoint(store, prefix="")
    assert set(as_stored.tensors) == {"model." + key for key in written["tied"].reference}
    assert all(key.startswith("optim.") for key in as_stored.skipped)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_workers_shares_rebuild_every_tensor_exactly_read_in_place(written, name, workers, tmp_path):
    """Every saved chunk read once, by one worker, as views of the rank files themselves."""
    checkpoint = find_dcp_checkpoint(Store(written[name].path))
    reference = written[name].reference
    loaded, held = read_shares(checkpoint, workers)
    assert set(loaded.worker_of_rank.values()) <= set(range(workers)) and set(held) == set(loaded.worker_of_rank)
    chunks = {(key, info.offset) for infos in loaded.rank_infos.values() for key, info in infos.items()}
    assert len(chunks) == sum(len(infos) for infos in loaded.rank_infos.values())  # none read twice
    rebuilt = rebuild(held, reference)
    for key, tensor in reference.items():
        assert rebuilt[key].dtype == tensor.dtype and torch.equal(rebuilt[key], tensor), key
    # --dry-run's share, each part described from .metadata alone: the same as the one read
    planned = checkpoint.share(workers, {}, lambda parts: {
        rank: infos for part in parts.values() for rank, infos in checkpoint.describe_part(part).items()
    })
    assert planned.rank_infos == loaded.rank_infos and planned.worker_of_rank == loaded.worker_of_rank
    rank_files = {os.path.realpath(os.path.join(written[name].path, file)) for file in checkpoint.read_files()}
    for tensors in held.values():  # mapped where they lie, each file once for all of a worker's pseudo-ranks
        assert set(tensors.maps.maps) <= rank_files and len(tensors.mapped_ranges()) == len(tensors.maps.maps)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_file_read_alone_gives_its_chunks_in_place_which_together_rebuild_every_tensor(written, name, tmp_path):
    """How a checkpoint spread over nodes is read: file by file, each chunk a view of its bytes
    where they lie in the file (nothing spooled), placed by its offset, and nothing read from any
    other file."""
    store = Store(written[name].path)
    checkpoint = find_dcp_checkpoint(store)
    reference = written[name].reference
    rebuilt = {key: torch.full_like(tensor, float("nan")) for key, tensor in reference.items()}
    chunks = list_chunks(checkpoint.tensors, read_metadata(store), store.uri)
    files = sorted(checkpoint.read_files())
    assert len(files) == 3 and {chunk.file for chunk in chunks} == set(files)
    shapes = {key: tensor.shape for key, tensor in checkpoint.tensors.items()}
    for file in files:
        alone = tmp_path / file
        alone.mkdir()
        os.symlink(os.path.join(store.path(), file), alone / file)  # the only data file it can reach
        for slot in slot_chunks([chunk for chunk in chunks if chunk.file == file], {}):
            held = read_in_place(Store(str(alone)), {0: slot}, shapes)[0]
            assert held.mapped_ranges()  # views of the file itself
            for key, info in held.describe().items():
                assert info.global_shape == tuple(reference[key].shape) and info.offset is not None
                region = tuple(slice(start, start + size) for start, size in zip(info.offset, info.local_shape))
                rebuilt[key][region] = held[key]
    for key, tensor in reference.items():
        assert torch.equal(rebuilt[key], tensor), key


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_chunks_are_shared_by_bytes_with_tied_boxes_together(written, workers):
    """Every saved chunk goes to exactly one worker, the shares within the largest chunk of each
    other, and each box of a tied pair lands with its twin, in the same slot."""
    store = Store(written["tied"].path)
    checkpoint = find_dcp_checkpoint(store)
    chunks = list_chunks(checkpoint.tensors, read_metadata(store), store.uri)
    tie_groups = {"lm_head.weight": "model.embed_tokens.weight"}
    shares = share_chunks(chunks, workers, tie_groups)
    shared = [chunk for share in shares.values() for chunk in share]
    assert len(shared) == len(chunks) and set(shared) == set(chunks)
    loads = [sum(chunk.nbytes for chunk in shares.get(worker, [])) for worker in range(workers)]
    largest_unit = max(chunk.nbytes for chunk in chunks) * 2
    assert max(loads) - min(loads) <= largest_unit
    for share in shares.values():
        for slot in slot_chunks(share, tie_groups):
            keys = [chunk.key for chunk in slot]
            assert len(keys) == len(set(keys))  # a pseudo-rank holds one chunk of a tensor
            boxes = {chunk.key: chunk.offset for chunk in slot}
            if "lm_head.weight" in boxes or "model.embed_tokens.weight" in boxes:
                assert boxes.get("lm_head.weight") == boxes.get("model.embed_tokens.weight")


def test_tied_copies_saved_in_other_boxes_never_meet_in_a_slot():
    """Twins saved in the same boxes meet box by box; a twin cut otherwise shares no slot with
    the other, so its values are never compared with another box's (the pair then goes
    uncompared, which the export refuses by name rather than comparing the wrong rows)."""
    def chunk(key, row, rows):
        return DcpChunk(key, (row, 0), (rows, 4), "__0_0.distcp", row * 100, 100, "float32")

    groups = {"lm_head.weight": "embed.weight"}
    same = [chunk("embed.weight", 0, 2), chunk("embed.weight", 2, 2), chunk("lm_head.weight", 2, 2), chunk("lm_head.weight", 0, 2)]
    assert [{(c.key, c.offset) for c in slot} for slot in slot_chunks(same, groups)] == [
        {("embed.weight", (0, 0)), ("lm_head.weight", (0, 0))}, {("embed.weight", (2, 0)), ("lm_head.weight", (2, 0))},
    ]
    other = [chunk("embed.weight", 0, 2), chunk("embed.weight", 2, 2), chunk("lm_head.weight", 0, 3), chunk("lm_head.weight", 3, 1)]
    for slot in slot_chunks(other, groups):
        assert len({c.key for c in slot}) == len(slot) == 1


def test_a_record_that_does_not_match_its_metadata_is_one_line(written, tmp_path):
    """A `.distcp` file rewritten since `.metadata` was read: the chunk's record is refused by
    name, not read as other bytes."""
    folder = copy_checkpoint(written["flat"].path, tmp_path / "ckpt")
    store = Store(folder)
    checkpoint = find_dcp_checkpoint(store)
    chunks = list_chunks(checkpoint.tensors, read_metadata(store), store.uri)
    chunk = max(chunks, key=lambda chunk: chunk.nbytes)
    shifted = dataclasses.replace(chunk, start=chunk.start + 1)
    with pytest.raises(ExportError, match=f"'{chunk.key}'|{chunk.file}"):
        read_in_place(store, {0: [shifted]}, {key: tensor.shape for key, tensor in checkpoint.tensors.items()})


def test_a_share_in_s3_rebuilds_every_tensor_fetching_each_piece_as_one_range(written, s3_endpoint, tmp_path, monkeypatch):
    """From object storage nothing is spooled: a worker finds each chunk's record with a few
    small ranged reads, then fetches the bytes of each piece the transfer asks for, one range
    each, exactly those bytes. (torch's own reader goes through fsspec's read-ahead cache: a
    worker fetched blocks of 50 MiB, whole rank files here, most of them other workers' tensors.)"""
    import s3fs

    root = f"s3://{BUCKET}/dcp-{uuid.uuid4().hex[:8]}"
    fetched = []
    call_s3 = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        response = await call_s3(self, method, *args, **kwargs)
        if method == "get_object" and kwargs["Key"].endswith(".distcp"):
            fetched.append(response["ContentLength"])
        return response

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    for name in ("tied", "flat"):
        uri = upload(written[name].path, f"{root}/{name}")
        store = Store(uri, {"endpoint_url": s3_endpoint})
        assert not store.is_local and detect_layout(store).name == "dcp"
        checkpoint = find_dcp_checkpoint(store)
        local = find_dcp_checkpoint(Store(written[name].path))
        assert (checkpoint.prefix, checkpoint.tensors, checkpoint.skipped) == (local.prefix, local.tensors, local.skipped)
        loaded, held = read_shares(checkpoint, 2)
        reference = written[name].reference
        for rank, tensors in held.items():
            assert tensors.fetches
            for key, info in tensors.describe().items():
                rows = info.local_shape[0] // 2
                if not rows or len(info.local_shape) != 2:
                    continue
                region = ((rows, info.local_shape[0] - rows, 1), (0, info.local_shape[1], 1))
                piece = Piece(rank, key, (info.offset[0] + rows, 0), (info.local_shape[0] - rows, info.local_shape[1]),
                              info.dtype, region, (0, 1))
                fetched.clear()
                values = tensors.values(piece)
                assert fetched == [piece.nbytes]  # one request, for exactly the piece's bytes
                assert torch.equal(values, reference[key][info.offset[0] + rows:info.offset[0] + info.local_shape[0]])
        rebuilt = rebuild(held, reference)
        assert all(torch.equal(rebuilt[key], tensor) for key, tensor in reference.items())
    assert not os.listdir(tmp_path)
    missing = Store(f"{root}/absent", {"endpoint_url": s3_endpoint})
    assert detect_layout(missing) is None
    with pytest.raises(ExportError) as error:
        find_dcp_checkpoint(missing)
    assert_one_line_naming(error, missing.uri)


def test_missing_metadata_is_an_export_error(written, tmp_path):
    folder = copy_checkpoint(written["flat"].path, tmp_path / "ckpt")
    os.remove(os.path.join(folder, DCP_METADATA))
    store = Store(folder)
    assert snapshot(store) is None  # not complete: a watcher waits for .metadata
    with pytest.raises(ExportError, match="no DCP metadata") as error:
        find_dcp_checkpoint(store)
    assert_one_line_naming(error, folder)


def test_an_unchanged_metadata_file_is_read_once_and_a_changed_one_again(written, tmp_path, monkeypatch):
    """What a watcher's pass asks of a DCP folder (its completion marker, twice around the settle
    time; then the layout `auto` detects and its description) reads `.metadata` once while it
    is unchanged; written again, it is read again."""
    folder = copy_checkpoint(written["tied"].path, tmp_path / "ckpt")
    reads = []
    read_bytes = Store.read_bytes
    monkeypatch.setattr(Store, "read_bytes", lambda store, name: reads.append(name) or read_bytes(store, name))
    store = Store(folder)
    assert snapshot(store) == snapshot(store) is not None
    assert find_checkpoint(store, "auto", SourceSettings()).layout == "dcp"
    assert reads == [DCP_METADATA]
    path = os.path.join(folder, DCP_METADATA)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))  # rewritten, same bytes
    find_checkpoint(store, "dcp", SourceSettings())
    assert reads == [DCP_METADATA, DCP_METADATA]


@pytest.mark.parametrize("keep", [0, 1000])
def test_truncated_metadata_is_an_export_error(written, tmp_path, keep):
    folder = copy_checkpoint(written["tied"].path, tmp_path / "ckpt")
    with open(os.path.join(folder, DCP_METADATA), "r+b") as handle:
        handle.truncate(keep)
    with pytest.raises(ExportError, match="cannot be read") as error:
        find_dcp_checkpoint(Store(folder))
    assert_one_line_naming(error, folder)


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_metadata_pickle_is_refused_unless_unsafe_pickle(written, tmp_path):
    """torch's own reader would run a `.metadata` pickle's code; only DCP's classes are allowed."""
    folder = copy_checkpoint(written["flat"].path, tmp_path / "ckpt")
    marker = tmp_path / "code-ran"
    with open(os.path.join(folder, DCP_METADATA), "wb") as handle:
        pickle.dump(_Payload(str(marker)), handle)
    with pytest.raises(ExportError, match="refusing to unpickle") as error:
        find_dcp_checkpoint(Store(folder))
    assert_one_line_naming(error, folder)
    assert not marker.exists()
    trusted = Store(written["tied"].path)
    unsafe = find_dcp_checkpoint(trusted, unsafe_pickle=True)
    assert unsafe.unsafe_pickle and dataclasses.replace(unsafe, unsafe_pickle=False) == find_dcp_checkpoint(trusted)


def test_prefix_without_tensors_is_an_export_error(written):
    store = Store(written["app"].path)
    with pytest.raises(ExportError, match="no model tensors") as error:
        find_dcp_checkpoint(store, prefix="model.")
    assert_one_line_naming(error, store.uri)


def test_a_missing_rank_file_is_one_line_naming_it(written, tmp_path):
    folder = copy_checkpoint(written["flat"].path, tmp_path / "ckpt")
    store = Store(folder)
    checkpoint = find_dcp_checkpoint(store)
    os.remove(os.path.join(folder, "__1_0.distcp"))
    with pytest.raises(ExportError, match="__1_0.distcp") as error:
        read_shares(checkpoint, 1)
    assert_one_line_naming(error, folder)
    # described again, the checkpoint is refused before any reading starts
    with pytest.raises(ExportError, match=r"^DCP checkpoint '.*' is missing '__1_0.distcp'$"):
        find_dcp_checkpoint(store)


def test_chunks_read_in_place_hold_a_nan_where_the_rank_file_does(written, tmp_path):
    """A chunk is its rank file's bytes: a NaN in one rank's chunk is in that chunk alone, where
    the source scan (`rayexport.common.scan`) finds it."""
    folder = copy_checkpoint(written["flat"].path, tmp_path / "ckpt")
    embedding = written["flat"].reference["model.embed_tokens.weight"]
    # rank 2 holds rows 668 on (see above); a value's bytes occur once in its file
    rank_file = os.path.join(folder, "__2_0.distcp")
    with open(rank_file, "rb") as handle:
        data = handle.read()
    value = embedding[700, 3].numpy().tobytes()
    assert data.count(value) == 1
    with open(rank_file, "wb") as handle:
        handle.write(data.replace(value, torch.tensor(float("nan")).numpy().tobytes()))
    _, held = read_shares(find_dcp_checkpoint(Store(folder)), 1)
    finite = {
        (key, info.offset[0]): is_finite(tensors[key])
        for tensors in held.values() for key, info in tensors.describe().items() if key == "model.embed_tokens.weight"
    }
    assert [offset for (_, offset), ok in finite.items() if not ok] == [668]


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    """A 160 MB float32 DCP checkpoint saved by 2 FSDP2 gloo ranks, and its tensors."""
    config = sized_llama_config(160 * 10**6, hidden_size=512, vocab_size=2048, dtype="float32")
    path = str(tmp_path_factory.mktemp("sized") / "dcp")
    _, reference = write_dcp_checkpoint(config, path, world_size=2, prefix="")
    return path, reference


def test_a_worker_holds_the_transfer_window_not_its_share(sized, tmp_path, ray_address):
    """As for verl input: a worker's memory stays at two buckets plus a chunk or so, whatever the
    share of the model it reads and sends."""
    path, reference = sized
    checkpoint = find_dcp_checkpoint(Store(path))
    store = Store(path)
    chunks = list_chunks(checkpoint.tensors, read_metadata(store), store.uri)
    shares = [sum(chunk.nbytes for chunk in share) for share in share_chunks(chunks, 2, {}).values()]
    entries = stored_entries(path)
    largest_chunk = max(
        math.prod(chunk.sizes) * entries[tensor.key].properties.dtype.itemsize
        for tensor in checkpoint.tensors.values() for chunk in entries[tensor.key].chunks
    )
    bound = 2 * BUCKET_SIZE + largest_chunk + HEADROOM
    assert min(shares) > bound  # each worker reads more than the bound
    assert max(tensor.nbytes for tensor in checkpoint.tensors.values()) <= BUCKET_SIZE  # none travels alone

    report = export(
        path, str(tmp_path / "out"), workers=2, writers=2, bucket_size=BUCKET_SIZE, max_shard_size="32MB",
        verify="none", dtype="float32",
    )

    for worker, growth in report.working_memory_bytes.items():
        assert growth is not None and growth <= bound, f"{worker} grew {growth / MiB:.0f} MiB"
    exported = {}
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / "out" / name), framework="pt") as handle:
                exported.update((key, handle.get_tensor(key)) for key in handle.keys())
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[key], reference[key]) for key in reference)
