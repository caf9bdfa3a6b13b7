"""benchmarks/gpu_check.py's dry run on CPU: the path a GPU machine without Ray takes (its
workers are local processes calling the very `ExportWorker` methods the Ray actors call, and
`run_export` drives them through a `WorkerGroup` subclass). Without a GPU only its gloo export
runs; this keeps that script working between the rare runs on a lent GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a whole export through local processes, each importing torch
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_exports_and_fully_verifies_without_ray_or_gpu(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run, even where this machine has a GPU
    # Ray is not installed on the GPU machine: here a `ray` that cannot be imported stands first
    # on the path, so an import of Ray on the way fails as it would there
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text('raise ImportError("no Ray on the GPU machine")\n')
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    result = completed.stdout.strip().splitlines()[-1] if completed.stdout.strip() else ""
    assert completed.returncode == 0, (result, completed.stderr[-3000:])
    assert result.startswith("gpu_check: PASS gpus=0 ray=False gloo_verified=full"), result
