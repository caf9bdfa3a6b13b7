"""rayexport.orchestration.pool: a warm pool hands the same worker actors to the next export of the same
shape, and close_pool removes them."""

from __future__ import annotations

import time

import ray

from rayexport import close_pool, export, export_remote
from support.helpers import export_worker_processes, reload

POOL = "tests"


def _export_worker_pids() -> set[int]:
    return {process.pid for process in export_worker_processes()}


def test_a_warm_pool_reuses_its_workers_until_closed(checkpoints, ray_address, tmp_path):
    try:
        first = export(checkpoints["tied"].path, str(tmp_path / "first"), workers=2, verify="none", pool=POOL)
        second = ray.get(export_remote(checkpoints["untied"].path, str(tmp_path / "second"), workers=2,
                                       verify="quick", pool=POOL), timeout=600)
        asked = time.time()
        third = export(checkpoints["tied"].path, str(tmp_path / "third"), workers=2, verify="quick", pool=POOL)
        assert not first.warm_start and second.warm_start and third.warm_start
        # the pool readied the reload's process when the second export ended, not when the third began
        assert third.reload_process["started_at"] < asked
        assert first.reload_process == {}  # --verify none starts none
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


def test_a_failed_export_leaves_no_idle_group_in_its_pool(checkpoints, ray_address, tmp_path):
    """The workers started and loaded the shards, then the export failed (a NaN weight under
    --strict): they are removed, not handed to the next export."""
    import glob
    import shutil

    import pytest
    import torch
    import torch.distributed.tensor  # noqa: F401 - DTensors in the rank files

    from rayexport.common.errors import ExportError

    source = shutil.copytree(checkpoints["tied"].path, tmp_path / "ckpt")
    for path in glob.glob(f"{source}/model_world_size_*_rank_*.pt"):
        state = torch.load(path, weights_only=True)
        state["model.norm.weight"].to_local().fill_(float("nan"))
        torch.save(state, path)
    pool = "tests-failed"
    try:
        with pytest.raises(ExportError, match="model.norm.weight' holds NaN"):
            export(str(source), str(tmp_path / "out"), workers=2, verify="none", pool=pool, strict=True)
    finally:
        idle = close_pool(pool)
    assert idle == 0
    assert not (tmp_path / "out" / "export_manifest.json").exists()


DESCRIBE_IN_ANOTHER_PROCESS = """
import json, sys
import ray
from rayexport.model.description import describe_model
from rayexport.orchestration.pool import PoolDescriptions
from rayexport.storage.store import Store
ray.init(logging_level="ERROR")
described = describe_model(Store(sys.argv[1]), None, False, described=PoolDescriptions(sys.argv[2]))
print(json.dumps({"transformers": "transformers" in sys.modules, "expected": sorted(described.formats.disk.expected)}))
"""


def test_a_pool_keeps_the_model_description_for_exports_from_other_processes(ray_address, tmp_path, monkeypatch):
    """A command line run with --pool is a process of its own: the model the previous run
    described is described again from the pool, without building it or importing transformers
    (nor reading a description saved in a file: `rayexport.model.saved`, off here)."""
    import json
    import subprocess
    import sys

    from rayexport.model.description import describe_model
    from rayexport.orchestration.pool import PoolDescriptions
    from rayexport.storage.store import Store
    from support.models import tiny_config, write_hf_folder

    folder = str(tmp_path / "hf")
    write_hf_folder(tiny_config("qwen2-tied"), folder)
    monkeypatch.setenv("RAYEXPORT_CACHE", "")
    try:
        first = describe_model(Store(folder), None, False, described=PoolDescriptions("described"))
        again = subprocess.run([sys.executable, "-c", DESCRIBE_IN_ANOTHER_PROCESS, folder, "described"],
                               capture_output=True, text=True, timeout=300, check=True)
        found = json.loads(again.stdout.strip().splitlines()[-1])
        assert found == {"transformers": False, "expected": sorted(first.formats.disk.expected)}
    finally:
        close_pool("described")
