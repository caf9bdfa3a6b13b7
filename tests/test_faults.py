"""Storage faults injected between rayexport and the S3 server (tests/fault_proxy.py), and a
driver killed mid-export: transient faults are retried and change no byte; persistent ones end
the run quickly with the object and operation named, and leave nothing that looks committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import s3fs

from fault_proxy import FaultProxy
from helpers import BUCKET, run_main
from rayexport.errors import ExportError
from rayexport.job import export
from rayexport.manifest import MANIFEST_NAME
from rayexport.verify import verify_uri

pytestmark = pytest.mark.usefixtures("ray_address")

# Few attempts keep a persistent fault's retries short in the tests (botocore's default here is
# 5 attempts; s3fs adds its own rounds for throttling and dropped connections).
RETRIES = {"config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}}}


@pytest.fixture(scope="module")
def proxy(s3_endpoint):
    proxy = FaultProxy(s3_endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def clean_export(proxy, s3_checkpoints):
    """One export through the proxy with no faults: the reference bytes, and how many
    requests an export makes."""
    proxy.reset()
    destination = f"s3://{BUCKET}/faults/clean"
    export(s3_checkpoints["tied"], destination, workers=2, verify="quick", storage_options=_through(proxy))
    return {"destination": destination, "requests": proxy.count, "objects": _objects(destination)}


def _through(proxy: FaultProxy) -> dict:
    return {"endpoint_url": proxy.endpoint, **RETRIES}


def _objects(prefix: str) -> dict[str, bytes]:
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    root = prefix.removeprefix("s3://")
    return {path[len(root) + 1:]: fs.cat_file(path) for path in fs.find(root)}


def assert_not_committed(destination: str) -> None:
    """What `python -m rayexport.verify DST` finds there (its check, run in this process)."""
    with pytest.raises(ExportError, match="is not a committed export"):
        verify_uri(destination)


def _manifest_without_time(objects: dict[str, bytes]) -> dict:
    import json

    manifest = json.loads(objects[MANIFEST_NAME])
    manifest.pop("created")
    return manifest


def test_transient_faults_are_retried_and_change_no_byte(proxy, clean_export, s3_checkpoints):
    every = 5  # never two in a row, so a retried request always gets through
    faults = {number: ("503", "500", "cut")[(number // every) % 3] for number in range(every, 4 * clean_export["requests"], every)}
    proxy.reset(faults)
    destination = f"s3://{BUCKET}/faults/transient"
    export(s3_checkpoints["tied"], destination, workers=2, verify="quick", storage_options=_through(proxy))

    injected = {fault for _, fault, _, _ in proxy.injected}
    assert injected == {"500", "503", "cut"} and len(proxy.injected) >= 10
    objects = _objects(destination)
    reference = clean_export["objects"]
    assert sorted(objects) == sorted(reference)
    for name in objects:
        if name != MANIFEST_NAME:
            assert objects[name] == reference[name], name
    # the same export twice gives the same manifest, apart from when it was made
    assert _manifest_without_time(objects) == _manifest_without_time(reference)


@pytest.mark.parametrize("fraction, fault", [(0.02, "500"), (0.45, "cut"), (0.9, "500")])
def test_a_persistent_fault_ends_the_run_quickly_and_commits_nothing(proxy, clean_export, s3_checkpoints, fraction, fault):
    start = max(1, round(fraction * clean_export["requests"]))
    proxy.reset(from_request=(start, fault))
    destination = f"s3://{BUCKET}/faults/persistent-{start}-{fault}"
    started = time.monotonic()
    with pytest.raises(ExportError) as failure:
        export(s3_checkpoints["tied"], destination, workers=2, verify="quick", storage_options=_through(proxy))
    elapsed = time.monotonic() - started
    message = str(failure.value)
    proxy.reset()  # the fault is over: look at what it left

    assert "s3://" in message and "failed for" in message, message  # the object and the operation
    assert elapsed < 90, f"a persistent fault took {elapsed:.0f} s to end the run"
    objects = _objects(destination)
    assert MANIFEST_NAME not in objects
    for name, data in objects.items():  # anything visible is whole: no truncated object
        assert data == clean_export["objects"][name], name
    assert_not_committed(destination)
    assert run_main("--cleanup", destination).returncode == 0
    bucket_uploads = s3fs.S3FileSystem().list_multipart_uploads(BUCKET)
    assert not [upload for upload in bucket_uploads if upload["Key"].startswith(destination.split("/", 3)[3])]


def test_a_killed_driver_leaves_no_committed_export(s3_checkpoints):
    """SIGKILL the CLI inside the export (its Ray actors die with their owner)."""
    delay = 5.0
    destination = f"s3://{BUCKET}/faults/killed"
    command = [sys.executable, "-m", "rayexport.run", "--src", s3_checkpoints["tied"], "--dst", destination,
               "--workers", "2", "--verify", "full"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    time.sleep(delay + 7.0)  # about 7 s of interpreter, torch and Ray start-up, then into the export
    still_running = process.poll() is None
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert still_running, "the export finished before it could be killed; kill it earlier"

    objects = _objects(destination)
    assert MANIFEST_NAME not in objects
    assert_not_committed(destination)
    assert run_main("--cleanup", destination).returncode == 0
    # a re-run after the kill reuses nothing partial and commits a whole export
    assert run_main("--src", s3_checkpoints["tied"], "--dst", destination, "--workers", "2", "--verify", "quick").returncode == 0
    assert MANIFEST_NAME in _objects(destination)
