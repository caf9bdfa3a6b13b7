"""rayexport.layouts.verl: what a verl checkpoint prefix holds, and how it is spread over the
workers: rank 0 first (on the exporter), then only the ranks HSDP needs, whole files each.
Rank files here are names and sizes only; test_end_to_end.py reads real FSDP2 ones."""

from __future__ import annotations

import json

import pytest
from support.plan_cases import EMBED, NORM, extent_info, fsdp2_ranks

from rayexport.common.errors import ExportError
from rayexport.layouts.verl import find_verl_checkpoint, spans
from rayexport.storage.store import Store


def verl_folder(folder, world_size: int, ranks=None, fsdp_config: dict | None = None, hf: bool = True) -> Store:
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size) if ranks is None else ranks:
        (folder / f"model_world_size_{world_size}_rank_{rank}.pt").write_bytes(b"x" * (rank + 1))
    if fsdp_config is not None:
        (folder / "fsdp_config.json").write_text(json.dumps(fsdp_config))
    if hf:
        (folder / "huggingface").mkdir(exist_ok=True)
        (folder / "huggingface" / "config.json").write_text("{}")
    return Store(str(folder))


def recording_load(infos_of_rank):
    """A load step that answers from `infos_of_rank` and records what each step asked for."""
    steps = []

    def load(parts):
        steps.append(dict(parts))
        return {rank: infos_of_rank(rank) for ranks in parts.values() for rank in ranks}

    return load, steps


def test_a_checkpoint_records_its_ranks_version_and_config_folder(tmp_path):
    store = verl_folder(tmp_path / "actor", 3, fsdp_config={"FSDP_version": 2, "world_size": 3})
    checkpoint = find_verl_checkpoint(store)
    assert (checkpoint.world_size, checkpoint.layout, checkpoint.uri) == (3, "verl-fsdp2", store.uri)
    assert checkpoint.rank_files == tuple(f"model_world_size_3_rank_{rank}.pt" for rank in range(3))
    assert checkpoint.hf_folder.exists("config.json")
    assert checkpoint.part_bytes([0, 2]) == 1 + 3


@pytest.mark.parametrize("case, message", [
    ("mismatch", "says world_size 4 but the rank files are for world size 2"),
    ("missing", "missing rank file '.*model_world_size_3_rank_1.pt'"),
    ("sizes", r"rank files of several world sizes \(2, 3\)"),
])
def test_an_inconsistent_checkpoint_is_one_line_naming_the_file(tmp_path, case, message):
    if case == "mismatch":
        store = verl_folder(tmp_path, 2, fsdp_config={"world_size": 4})
    elif case == "missing":
        store = verl_folder(tmp_path, 3, ranks=[0, 2])
    else:
        verl_folder(tmp_path, 2)
        store = verl_folder(tmp_path, 3)
    with pytest.raises(ExportError, match=message) as error:
        find_verl_checkpoint(store)
    assert "\n" not in str(error.value)


def test_ranks_are_read_rank_zero_first_then_spread_in_blocks(tmp_path):
    """Rank 0 on worker 0 and, beside it, rank 1 on worker 1; then the rest in blocks."""
    checkpoint = find_verl_checkpoint(verl_folder(tmp_path, 4))
    ranks = fsdp2_ranks({EMBED: (10, 4), NORM: (4,)}, 4)
    load, steps = recording_load(lambda rank: ranks[rank])
    loaded = checkpoint.share(2, {}, load)
    assert steps == [{0: [0], 1: [1]}, {0: [2], 1: [3]}]
    assert loaded.worker_of_rank == {0: 0, 1: 1, 2: 0, 3: 1}
    assert sorted(loaded.holders[EMBED]) == [0, 1, 2, 3]


def test_an_hsdp_checkpoint_reads_one_replica_of_each_shard(tmp_path):
    """A 2x2 ("ddp", "fsdp") mesh: ranks 2 and 3 replicate ranks 0 and 1, and are never read;
    ranks 0 and 1, the first replica, are read in one step."""
    checkpoint = find_verl_checkpoint(verl_folder(tmp_path, 4))

    def infos(rank):
        coordinate = divmod(rank, 2)
        return {key: extent_info(shape, ("R", "S0"), (2, 2), coordinate) for key, shape in ((EMBED, (10, 4)), (NORM, (4,)))}

    load, steps = recording_load(infos)
    loaded = checkpoint.share(2, {}, load)
    assert steps == [{0: [0], 1: [1]}]
    assert sorted(loaded.rank_infos) == [0, 1] and loaded.worker_of_rank == {0: 0, 1: 1}
    assert sorted(loaded.holders[EMBED]) == [0, 1]


def test_missing_ranks_are_named_as_runs():
    assert spans([5, 0, 1, 2, 8, 9]) == "0-2, 5, 8-9"
    assert spans([3]) == "3"
