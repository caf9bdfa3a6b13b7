"""rayexport.orchestration.start: a driver plans its export and starts its workers without
importing torch, which its workers import in their own processes."""

from __future__ import annotations

import json
import subprocess
import sys

from support.deepspeed_checkpoints import source_of

# The start of a driver's code that refuses torch and transformers: an import of either fails.
REFUSING_TORCH = """
import json, runpy, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"the driver imported {name}")

sys.meta_path.insert(0, NoTorch())
"""

# A driver that refuses torch while it joins the session's Ray and begins an export of a verl
# checkpoint (the plan, the placement group, the actors and their process group), which the
# description of a model not described before, in the planning thread, needs: that thread fails. Then, torch allowed (the workers' answers are objects of
# their module), it asks the workers to load, and prints what it saw.
STARTS_WITHOUT_TORCH = REFUSING_TORCH + """import ray
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.start import begin_export
ray.init(logging_level="ERROR")
started = begin_export(ExportOptions(src=sys.argv[1], dst=sys.argv[2], verify="none", workers=2))
driver_torch = "torch" in sys.modules
describing = repr(started.describing.exception())
sys.meta_path.pop(0)
try:
    pids = ray.get([actor.stats.remote() for actor in started.group.actors])
    loaded = started.group.load(started.plan.checkpoint, {})
    print(json.dumps({"workers": [stats.pid for stats in pids], "ranks": sorted(loaded.rank_infos),
                      "driver_torch": driver_torch, "describing": describing}))
finally:
    started.group.shutdown(graceful=False)
"""


def test_the_driver_starts_its_workers_and_they_load_without_it_importing_torch(checkpoints, ray_address, tmp_path, monkeypatch):
    """What lets a command line joined to a running cluster ask for its workers at once: nothing
    on the way to them (planning, placement, the actors, their process group) imports torch in
    the driver."""
    monkeypatch.setenv("RAYEXPORT_CACHE", "")  # the model described afresh: transformers wanted
    ran = subprocess.run(
        [sys.executable, "-c", STARTS_WITHOUT_TORCH, checkpoints["tied"].path, str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert len(set(seen["workers"])) == 2 and seen["ranks"] == [0, 1, 2] and seen["driver_torch"] is False
    assert "the driver imported" in seen["describing"]  # the description alone wanted them


# The command line, in a process that refuses torch and transformers from its start.
COMMAND_LINE_WITHOUT_TORCH = REFUSING_TORCH + """sys.argv = ["rayexport.run", *sys.argv[1:]]
runpy.run_module("rayexport.run", run_name="__main__")
"""


def test_a_later_export_of_a_model_runs_its_driver_without_torch(checkpoints, ray_address, tmp_path, monkeypatch):
    """Once a model is described (and saved), the command line's driver plans, starts, gathers,
    checks and commits a later export of it with torch and transformers in its workers and the
    reload's process alone: its CPU goes to them."""
    exports_twice_the_second_without_torch(checkpoints["tied"].path, [], tmp_path, monkeypatch)


def test_a_later_export_of_a_deepspeed_save_runs_its_driver_without_torch(deepspeed_checkpoints, ray_address, tmp_path,
                                                                           monkeypatch):
    """A ZeRO save's runs are placed in its rank files by the sizes of their dtypes, without
    torch too (importing it was a second of the driver's plan)."""
    source, options = source_of(deepspeed_checkpoints["zero3-bf16-tied-zero-init"])
    exports_twice_the_second_without_torch(source, options, tmp_path, monkeypatch)


def exports_twice_the_second_without_torch(source: str, options: list[str], tmp_path, monkeypatch) -> None:
    """Export `source` through the command line (unverified: it is there to describe the model),
    then again from a process that refuses torch and transformers: the second export is
    committed and verified."""
    monkeypatch.setenv("RAYEXPORT_CACHE", str(tmp_path / "cache"))
    arguments = ["--src", source, *options, "--log-level", "WARNING"]
    first = subprocess.run(
        [sys.executable, "-m", "rayexport.run", *arguments, "--verify", "none", "--dst", str(tmp_path / "first")],
        capture_output=True, text=True, timeout=300,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    later = subprocess.run(
        [sys.executable, "-c", COMMAND_LINE_WITHOUT_TORCH, *arguments, "--verify", "quick", "--dst", str(tmp_path / "later")],
        capture_output=True, text=True, timeout=300,
    )
    assert later.returncode == 0, later.stderr[-3000:]
    assert "verified (quick)" in later.stdout and (tmp_path / "later" / "export_manifest.json").exists()
