"""rayexport.pool: a warm pool hands the same worker actors to the next export of the same
shape, and close_pool removes them."""

from __future__ import annotations

import time

import ray

from helpers import export_worker_processes, reload
from rayexport import close_pool, export, export_remote

POOL = "tests"


def _export_worker_pids() -> set[int]:
    return {process.pid for process in export_worker_processes()}


def test_a_warm_pool_reuses_its_workers_until_closed(checkpoints, ray_address, tmp_path):
    try:
        first = export(checkpoints["tied"].path, str(tmp_path / "first"), workers=2, verify="none", pool=POOL)
        second = ray.get(export_remote(checkpoints["untied"].path, str(tmp_path / "second"), workers=2,
                                       verify="quick", pool=POOL), timeout=600)
        assert not first.warm_start and second.warm_start
        pids = {where["pid"] for where in first.placement.values()}
        assert {where["pid"] for where in second.placement.values()} == pids  # the same processes
        assert pids <= _export_worker_pids()  # idle in the pool, not removed
        # a reused worker carried nothing over: the second export is its own model
        assert reload(str(tmp_path / "second"))["shared"] is False
        assert reload(str(tmp_path / "first"))["shared"] is True
    finally:
        closed = close_pool(POOL)
    assert closed == 1
    deadline = time.monotonic() + 15
    while pids & _export_worker_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pids & _export_worker_pids()
    assert close_pool(POOL) == 0
