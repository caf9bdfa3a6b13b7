"""Storage faults injected between rayexport and the S3 server (tests/support/fault_proxy.py), and a
driver killed mid-export: transient faults are retried and change no byte; persistent ones end
the run quickly with the object and operation named, and leave nothing that looks committed.
A worker killed mid-export leaves none of the rank files spooled from S3 on the node's disk,
and the next export sweeps what dead workers left there (never a live export's); the workers a
test kills are found through its own Ray session, never by a process name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import s3fs

from rayexport.common.errors import ExportError
from rayexport.orchestration import spool
from rayexport.orchestration.job import export
from rayexport.transport.manifest import MANIFEST_NAME
from rayexport.verify import verify_uri
from support.checkpoints import write_synthetic_checkpoint
from support.fault_proxy import FaultProxy
from support.helpers import BUCKET, export_worker_processes, run_main, upload
from support.models import sized_llama_config

pytestmark = pytest.mark.usefixtures("ray_address")

# Few attempts keep a persistent fault's retries short in the tests (botocore's default here is
# 5 retries; s3fs's own retry loop is held to one round by Store). A connect timeout longer than
# the bound below keeps "waited for a timeout" apart from "gave up after its retries".
RETRIES = {"config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 90}}
ATTEMPTS = RETRIES["config_kwargs"]["retries"]["max_attempts"] + 1  # the call and its retries
# botocore's standard mode waits rand(0, 1) x min(2**i, 20) s before retry i (from 0): at most
# 1 + 2 + 4 = 7 s from a call's first attempt to its last
LADDER_S = sum(min(2**retry, 20) for retry in range(ATTEMPTS - 1))
# Once a persistent fault begins, the run ends after a failing call's ladder, at most two in a
# row (a write's parts, then its upload's abort; calls beside it fail alongside), and the removal
# of the worker group: 2.4 to 5.6 s in all, measured at seven fault positions on a loaded 2-CPU
# machine. Waiting out a timeout on the way takes 90 s or more (the connect timeout above; the
# read timeout is 120 s), and s3fs's 5 rounds of retries around botocore's (25 for reads) took
# 72 to 315 s. This bound, 45 s, tells those apart with room for a slow CI machine.
AFTER_FAULT_S = 3 * LADDER_S + 24


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


def _names(prefix: str) -> list[str]:
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    root = prefix.removeprefix("s3://")
    return [path[len(root) + 1:] for path in fs.find(root)]


def _objects(prefix: str) -> dict[str, bytes]:
    fs = s3fs.S3FileSystem()
    return {name: fs.cat_file(f"{prefix.removeprefix('s3://')}/{name}") for name in _names(prefix)}


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
    ended = time.monotonic()
    after_fault = ended - proxy.first_fault_at  # the time before it (Ray, the actors) is not the fault's
    message = str(failure.value)
    proxy.reset()  # the fault is over: look at what it left

    assert "s3://" in message and "failed for" in message, message  # the object and the operation
    assert after_fault < AFTER_FAULT_S, (
        f"the run ended {after_fault:.0f} s after a persistent fault began ({ended - started:.0f} s in all)"
    )
    objects = _objects(destination)
    assert MANIFEST_NAME not in objects
    for name, data in objects.items():  # anything visible is whole: no truncated object
        assert data == clean_export["objects"][name], name
    assert_not_committed(destination)
    assert run_main("--cleanup", destination).returncode == 0
    bucket_uploads = s3fs.S3FileSystem().list_multipart_uploads(BUCKET)
    assert not [upload for upload in bucket_uploads if upload["Key"].startswith(destination.split("/", 3)[3])]


def test_a_killed_driver_leaves_no_committed_export(s3_checkpoints):
    """SIGKILL the CLI inside the export, as soon as it has written its first object (its Ray
    actors die with their owner)."""
    destination = f"s3://{BUCKET}/faults/killed"
    command = [sys.executable, "-m", "rayexport.run", "--src", s3_checkpoints["tied"], "--dst", destination,
               "--workers", "2", "--verify", "full"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))

    def written() -> list[str]:
        return [name for name in _names(destination) if not name.startswith(".rayexport")]  # not the write probe

    deadline = time.monotonic() + 120
    while not written() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    still_running = process.poll() is None
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert still_running, "the export ended before it wrote anything"

    objects = _objects(destination)
    assert MANIFEST_NAME not in objects
    assert_not_committed(destination)
    assert run_main("--cleanup", destination).returncode == 0
    # a re-run after the kill reuses nothing partial and commits a whole export
    assert run_main("--src", s3_checkpoints["tied"], "--dst", destination, "--workers", "2", "--verify", "quick").returncode == 0
    assert MANIFEST_NAME in _objects(destination)


# --- a worker killed mid-export: its spooled rank files, and strangers' processes ------------

MiB = 2**20


@pytest.fixture(scope="module")
def s3_synthetic(tmp_path_factory, s3_endpoint):
    """A 64 MB world-size-2 checkpoint on S3: each worker spools a 32 MB rank file to its disk."""
    config = sized_llama_config(64 * 10**6, hidden_size=512, vocab_size=2048, dtype="float32")
    local = tmp_path_factory.mktemp("synthetic-s3") / "actor"
    write_synthetic_checkpoint(config, str(local), world_size=2)
    return upload(str(local), f"s3://{BUCKET}/checkpoints/synthetic")


@pytest.fixture
def stranger():
    """A process outside this session's Ray that looks like a worker by name, as another
    checkout's export or a benchmark on the same machine would."""
    process = subprocess.Popen(["bash", "-c", 'exec -a "ray::ExportWorkerActor" sleep 600'])
    deadline = time.monotonic() + 10
    while "ray::ExportWorkerActor" not in _cmdline(process.pid):
        assert time.monotonic() < deadline, "the stranger did not start"
        time.sleep(0.05)
    yield process
    process.kill()
    process.wait()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _spooled_files(pids: set[int]) -> dict[str, int]:
    """The rank files these processes map from the temp folder (their spooled copies), with
    their sizes."""
    tmp = os.path.realpath(tempfile.gettempdir()) + os.sep
    files = {}
    for pid in pids:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if path.startswith(tmp) and path.endswith(".pt"):
                    files[path] = os.path.getsize(path)
    return files


def test_a_worker_killed_mid_export_leaves_no_spooled_files_and_no_stranger_is_touched(s3_synthetic, stranger, tmp_path):
    destination = tmp_path / "out"
    before = {process.pid for process in export_worker_processes()}
    outcome: dict = {}

    def run() -> None:
        try:
            export(s3_synthetic, str(destination), workers=2, bucket_size=MiB // 4, max_shard_size="8MB", verify="none")
        except ExportError as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 180
    while not list(destination.glob("model-00001-of-*.safetensors")):  # loaded; the gather is under way
        assert thread.is_alive() and time.monotonic() < deadline, f"the export ended before a shard was written: {outcome}"
        time.sleep(0.02)
    listed = {process.pid for process in export_worker_processes()}
    assert stranger.pid not in listed  # workers are found through this session's Ray, not by name
    workers = listed - before
    assert len(workers) == 2
    spooled = _spooled_files(workers)
    assert len(spooled) == 2 and min(spooled.values()) > 25 * MiB  # each worker's ~30 MB rank file
    os.kill(max(workers), signal.SIGKILL)
    thread.join(timeout=180)

    assert "an export worker died" in str(outcome.get("error")), outcome
    left = {path: size for path, size in spooled.items() if os.path.exists(path)}
    assert not left, f"{sum(left.values())} bytes of spooled rank files left after the failed export: {sorted(left)}"
    assert not any(os.path.exists(os.path.dirname(path)) for path in spooled)
    assert stranger.poll() is None, "the test ended a process it did not start"


def test_an_export_sweeps_the_spool_dead_workers_left_and_keeps_live_ones(checkpoints, stranger, tmp_path):
    """Spool folders on this node: one whose worker is gone (its export's driver was killed), one
    whose worker still runs (another export, here the stranger stands in for its worker)."""
    root = spool.ensure_root(spool.spool_root())
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone_owner = spool.Owner(spool.pid_namespace(), gone.pid, spool.process_start(gone.pid))
    gone.kill()
    gone.wait()
    live_owner = spool.Owner(spool.pid_namespace(), stranger.pid, spool.process_start(stranger.pid))
    folders = {}
    for name, owner in (("dead", gone_owner), ("live", live_owner)):
        folders[name] = os.path.join(root, spool.new_export_id(3600), spool.worker_folder_name(0, owner))
        os.makedirs(folders[name])
        with open(os.path.join(folders[name], "model_world_size_3_rank_0.pt"), "wb") as handle:
            handle.write(os.urandom(MiB))
    try:
        export(checkpoints["tied"].path, str(tmp_path / "out"), workers=2, verify="none")

        assert not os.path.exists(os.path.dirname(folders["dead"]))
        assert os.path.getsize(os.path.join(folders["live"], "model_world_size_3_rank_0.pt")) == MiB
    finally:
        for path in folders.values():
            spool.remove_export(os.path.basename(os.path.dirname(path)), root)
