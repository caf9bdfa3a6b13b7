"""The cost of a planned export (`rayexport.plan.cost`): each worker's bytes, files and staging
from the transfer plan, the seconds at given rates, and `--rates` read in one line."""

from __future__ import annotations

import pytest

from rayexport.common.errors import ExportError
from rayexport.plan.cost import Rates, cost_table, export_cost
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import ShardFile, plan_transfer


def _plans() -> dict[str, TensorPlan]:
    """Two float32 tensors of 4 x 1000 rows' worth, each held half by rank 0 and half by rank 1."""
    def plan(name: str) -> TensorPlan:
        pieces = tuple(Piece(rank, name, (rank * 2, 0), (2, 1000), "float32") for rank in range(2))
        return TensorPlan(name, name, (4, 1000), "float32", "float32", pieces)

    return {name: plan(name) for name in ("a", "b")}


def test_each_worker_reads_sends_receives_and_writes_what_the_plan_gives_it():
    plans = _plans()
    files = [ShardFile("model-00001-of-00002.safetensors", ("a",)), ShardFile("model-00002-of-00002.safetensors", ("b",))]
    transfer = plan_transfer(files, plans, {0: 0, 1: 1}, num_workers=2, bucket_size=10**6, writers=2)
    sizes = {"model-00001-of-00002.safetensors": 16_100, "model-00002-of-00002.safetensors": 16_100}
    rates = Rates(read=1, gather=1, write=1, verify=1, reload=1, fixed=2)  # 1 MB/s: seconds are MB
    cost = export_cost(transfer, sizes, {0: 20_000, 1: 12_000}, ("node-a", "node-b"), 2, 32_000, 3 * 2**30, rates, True)
    first, second = cost.workers
    # each writer keeps its own half of its tensor and receives the other half (8000 bytes)
    assert (first.bytes_sent, first.bytes_received, second.bytes_sent, second.bytes_received) == (8000, 8000, 8000, 8000)
    assert first.files == ("model-00001-of-00002.safetensors",) and second.files == ("model-00002-of-00002.safetensors",)
    assert (first.bytes_read, first.bytes_written, first.node) == (20_000, 16_100, "node-a")
    assert first.staging_bytes == 2 * 8000  # the window of two buffers of its largest bucket on the wire
    assert first.seconds == pytest.approx((20_000 + 16_000 + 16_100) / 1e6, abs=0.01)
    assert cost.seconds["transfer"] == first.seconds  # the slower worker sets it
    assert cost.seconds["reload"] == pytest.approx(0.03, abs=0.01) and cost.seconds["fixed"] == 2
    assert cost.seconds["total"] == pytest.approx(sum(value for name, value in cost.seconds.items() if name != "total"))
    assert cost.over_bound() == []
    table = cost_table(cost)
    assert "node-a" in table and "1 on" in table  # a line per worker and one per node
    unverified = export_cost(transfer, sizes, {0: 1, 1: 1}, (), 2, 32_000, 3 * 2**30, rates, False)
    assert unverified.seconds["verify_files"] == 0 and unverified.seconds["reload"] == 0


def test_buffers_larger_than_the_bound_are_named():
    plans = _plans()
    transfer = plan_transfer([ShardFile("model.safetensors", ("a", "b"))], plans, {0: 0, 1: 1}, 2, 10**6, writers=1)
    cost = export_cost(transfer, {"model.safetensors": 32_100}, {}, (), 2, 32_000, 100, Rates(), True)
    assert cost.over_bound() == [0, 1]
    assert "worker(s) 0, 1: a tensor larger than --bucket-size travels alone" in cost_table(cost)


@pytest.mark.parametrize("text, message", [
    ("read=fast", "--rates: 'read=fast' is not NAME=NUMBER"),
    ("speed=3", "--rates: unknown rate 'speed'"),
    ("write=0", "--rates: write must be positive"),
])
def test_a_bad_rate_is_one_line_naming_it(text, message):
    with pytest.raises(ExportError, match=message):
        Rates.parse(text)


def test_rates_not_given_keep_their_defaults():
    assert Rates.parse("read=200, write=150") == Rates(read=200, write=150)
    assert Rates.parse("") == Rates()
