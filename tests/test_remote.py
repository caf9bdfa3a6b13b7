"""export_remote() from inside a running Ray program, as an RL trainer calls it."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import ray

from rayexport import ExportError, ExportFailed, export_remote
from support.helpers import reload


def test_returns_at_once_and_two_exports_run_side_by_side(checkpoints, ray_address, tmp_path):
    started = time.monotonic()
    tied = export_remote(checkpoints["tied"].path, str(tmp_path / "tied"), workers=2, num_gpus_per_worker=0)
    untied = export_remote(checkpoints["untied"].path, str(tmp_path / "untied"), workers=2, num_gpus_per_worker=0)
    assert time.monotonic() - started < 5
    assert ray.wait([tied, untied], num_returns=2, timeout=0)[0] == []  # still running: training goes on
    reports = ray.get([tied, untied], timeout=600)
    assert [report.backend for report in reports] == ["gloo", "gloo"]
    assert all(report.verification["passed"] for report in reports)
    assert reload(str(tmp_path / "tied"))["shared"] is True
    assert reload(str(tmp_path / "untied"))["shared"] is False
    assert ray.is_initialized()  # the caller's session is left as it was
    assert not [actor for actor in ray.util.list_named_actors() if "ExportWorker" in str(actor)]


def test_max_concurrent_queues_the_rest(checkpoints, ray_address, tmp_path):
    references = [
        export_remote(checkpoints["tied"].path, str(tmp_path / f"out{index}"), workers=1, max_concurrent=1,
                      verify="none")
        for index in range(2)
    ]
    first, second = ray.get(references, timeout=600)
    assert first.tensor_count == second.tensor_count


def test_failures_surface_as_a_typed_exception(ray_address, tmp_path):
    reference = export_remote(str(tmp_path / "missing"), str(tmp_path / "out"))
    with pytest.raises(ExportError) as error:
        ray.get(reference, timeout=120)
    assert isinstance(error.value, ExportFailed)
    assert f"source '{tmp_path / 'missing'}' does not exist" in str(error.value)


def test_a_failure_is_the_clis_one_line_even_from_a_multi_line_cause(checkpoints, ray_address, tmp_path):
    source = shutil.copytree(checkpoints["tied"].path, tmp_path / "ckpt")
    config_path = source / "huggingface" / "config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), model_type="no-such-model")))
    with pytest.raises(ExportFailed) as error:
        ray.get(export_remote(str(source), str(tmp_path / "out")), timeout=300)
    message = str(error.value)
    assert "\n" not in message and message.startswith("config.json cannot be loaded by transformers")
    assert "no-such-model" in message and "pip install --upgrade transformers" in message  # the cause's 1st and 3rd line


def test_bad_options_fail_before_anything_starts(ray_address, tmp_path):
    with pytest.raises(ExportError, match="--dtype must be one of"):
        export_remote(str(tmp_path), str(tmp_path / "out"), dtype="int8")
