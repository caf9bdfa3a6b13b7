"""rayexport.orchestration.placement: which backend and how many GPUs per worker, from the options and what
the cluster has free; and the one line naming what a placement lacks. Pure: the resources are
given here. tests/test_gpu_cluster.py runs the same choices against a Ray cluster advertising
GPUs, and tests/test_gpu.py the NCCL path itself where a GPU exists."""

import pytest

from rayexport.common.errors import ExportError
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.placement import (
    Devices, choose_devices, missing_resources, pin_writers, place_by_files, reading_node, worker_capacity,
)


def test_auto_takes_nccl_only_when_every_worker_finds_a_free_gpu():
    devices = choose_devices("auto", None, num_workers=4, free_gpus=4, total_gpus=8)
    assert (devices.backend, devices.gpus_per_worker, devices.fallback) == ("nccl", 1.0, True)
    assert devices.reason == "4 free GPU(s) for 4 worker(s) x 1"


def test_auto_counts_free_gpus_not_the_cluster_total():
    # an RL job: 8 GPUs in the cluster, the trainer holds 7 of them
    devices = choose_devices("auto", None, num_workers=2, free_gpus=1, total_gpus=8)
    assert devices == Devices("gloo", 0.0, "1 of the cluster's 8 GPU(s) free, 2 needed for NCCL")
    assert choose_devices("auto", None, num_workers=1, free_gpus=0, total_gpus=0) == Devices(
        "gloo", 0.0, "the Ray cluster has no GPUs"
    )


def test_zero_gpus_per_worker_keeps_an_export_off_the_gpus():
    devices = choose_devices("auto", 0, num_workers=2, free_gpus=8, total_gpus=8)
    assert (devices.backend, devices.gpus_per_worker) == ("gloo", 0.0)
    assert "--num-gpus-per-worker 0" in devices.reason


def test_auto_with_a_fraction_of_a_gpu_is_gloo_on_that_share():
    devices = choose_devices("auto", 0.5, num_workers=2, free_gpus=8, total_gpus=8)
    assert (devices.backend, devices.gpus_per_worker) == ("gloo", 0.5)
    assert "fraction of a GPU" in devices.reason


def test_gpus_asked_for_under_auto_are_waited_for_not_dropped():
    # whole GPUs asked for but none free: NCCL, and the placement names what is missing
    devices = choose_devices("auto", 2, num_workers=2, free_gpus=0, total_gpus=8)
    assert (devices.backend, devices.gpus_per_worker, devices.fallback) == ("nccl", 2.0, False)


def test_explicit_backends():
    assert choose_devices("gloo", None, num_workers=2, free_gpus=8, total_gpus=8) == Devices("gloo", 0.0, "--backend gloo")
    assert choose_devices("gloo", 0.5, num_workers=2, free_gpus=8, total_gpus=8).gpus_per_worker == 0.5
    # nccl waits for GPUs that exist but are busy...
    assert choose_devices("nccl", None, num_workers=2, free_gpus=0, total_gpus=2) == Devices("nccl", 1.0, "--backend nccl")
    # ...and is refused at once where the cluster does not have them at all
    with pytest.raises(ExportError, match=r"^--backend nccl needs 4 GPU\(s\) \(2 worker\(s\) x 2\); the Ray cluster has 2$"):
        choose_devices("nccl", 2, num_workers=2, free_gpus=2, total_gpus=2)


@pytest.mark.parametrize("gpus, why", [
    (0.5, "is not a whole number (NCCL refuses two ranks on one device)"),
    (1.5, "is not a whole number"),
    (0, "gives it none"),
])
def test_nccl_without_a_whole_gpu_per_worker_is_refused_by_the_options(gpus, why):
    with pytest.raises(ExportError, match=r"^--backend nccl needs a whole GPU per worker; --num-gpus-per-worker") as error:
        ExportOptions(src="a", dst="b", backend="nccl", num_gpus_per_worker=gpus)
    assert why in str(error.value) and "\n" not in str(error.value)


def test_missing_resources_names_each_short_resource():
    bundle = {"CPU": 1.0, "GPU": 1.0}
    assert missing_resources(bundle, 2, free={"CPU": 6.0, "GPU": 0.0}, total={"CPU": 8.0, "GPU": 2.0}) == (
        "missing GPU 2 needed, 0 free of 2"
    )
    assert missing_resources(bundle, 2, free={"CPU": 1.0}, total={"CPU": 8.0}) == (
        "missing CPU 2 needed, 1 free of 8; GPU 2 needed, 0 free of 0"
    )
    assert "not on the nodes together" in missing_resources(bundle, 2, free={"CPU": 2.0, "GPU": 2.0}, total={"CPU": 2.0, "GPU": 2.0})


# --- workers placed by where a checkpoint's files are (node-local disks) ------------------------

LABELS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}


def rank_files(world: int, size: int = 100) -> dict[str, int]:
    return {f"rank_{rank}.pt": size for rank in range(world)}


def test_each_file_is_read_on_a_node_that_holds_it_rank_0_by_worker_0():
    files = rank_files(4)
    holders = {"rank_0.pt": ("b",), "rank_1.pt": ("b",), "rank_2.pt": ("a",), "rank_3.pt": ("a",)}
    placed = place_by_files(files, holders, "b", 4, {"a": 2, "b": 2}, LABELS)
    assert placed.worker_nodes == ("b", "b", "a", "a")
    assert placed.file_readers["rank_0.pt"] == 0
    for name, worker in placed.file_readers.items():
        assert placed.worker_nodes[worker] in holders[name], name
    assert sorted(placed.file_readers.values()) == [0, 1, 2, 3]  # one file each: balanced


def test_a_file_on_two_nodes_is_read_once_on_the_less_loaded():
    files = {"rank_0.pt": 100, "rank_1.pt": 100, "shared.pt": 50}
    holders = {"rank_0.pt": ("a",), "rank_1.pt": ("a",), "shared.pt": ("a", "b")}
    placed = place_by_files(files, holders, "a", 2, {"a": 4, "b": 4}, LABELS)
    assert placed.worker_nodes == ("a", "b")
    assert placed.file_readers == {"rank_0.pt": 0, "rank_1.pt": 0, "shared.pt": 1}


def test_every_node_holding_files_gets_a_worker_even_beyond_the_count_asked():
    holders = {"rank_0.pt": ("a",), "rank_1.pt": ("b",), "rank_2.pt": ("c",)}
    placed = place_by_files(rank_files(3), holders, "a", 1, {"a": 1, "b": 1, "c": 1}, LABELS)
    assert placed.worker_nodes == ("a", "b", "c")


def test_extra_workers_go_where_the_bytes_are_within_each_nodes_room():
    files = {"rank_0.pt": 100, "rank_1.pt": 400, "rank_2.pt": 400, "rank_3.pt": 400}
    holders = {"rank_0.pt": ("a",), "rank_1.pt": ("b",), "rank_2.pt": ("b",), "rank_3.pt": ("b",)}
    placed = place_by_files(files, holders, "a", 4, {"a": 4, "b": 2}, LABELS)
    assert placed.worker_nodes == ("a", "a", "b", "b")  # b holds most, but has room for 2 only


def test_writers_of_a_local_destination_sit_on_its_node():
    holders = {"rank_0.pt": ("a",), "rank_1.pt": ("b",)}
    placed = place_by_files(rank_files(2), holders, "a", 2, {"a": 2, "b": 2}, LABELS, writers=2)
    assert placed.worker_nodes[:2] == ("a", "a") and "b" in placed.worker_nodes
    assert pin_writers("a", 4, 2, {"a": 8}).worker_nodes == ("a", "a", None, None)
    assert pin_writers("a", 4, 3, {"a": 1}).worker_nodes == ("a", None, None, None)  # room for one


def test_a_file_only_on_nodes_without_room_is_one_line_naming_them():
    with pytest.raises(ExportError, match=r"^'/ckpt/rank_1.pt' is only on 10.0.0.2, where no worker of this export fits$"):
        reading_node(("b",), {"a": 1, "b": 0}, "/ckpt/rank_1.pt", LABELS)
    assert worker_capacity({"CPU": 8.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}) == 2
    assert worker_capacity({"CPU": 0.0}, {"CPU": 1.0}) == 0
