"""Bad input through the CLI: one clear line naming what is wrong, a non-zero exit, and no
manifest at the destination. Most cases call the CLI's main() in this process (`run_main`),
which prints and exits exactly as `python -m rayexport.run` does without paying a new
interpreter's start-up; the cases about stderr, logging and argument errors run the real
command."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from support.helpers import error_lines, export_worker_processes, run_cli, run_main, s3_exists, workers_left

pytestmark = pytest.mark.usefixtures("ray_address")

PARTIAL_WRITER = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
path = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
state = torch.load(path, weights_only=True)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
key = "model.norm.weight"
state[key] = DTensor.from_local(state[key].to_local(), mesh, [Partial()])
torch.save(state, path)
dist.destroy_process_group()
"""


@pytest.fixture
def broken_copy(checkpoints, tmp_path):
    """A private copy of the tied world-size-3 checkpoint to damage."""
    return shutil.copytree(checkpoints["tied"].path, tmp_path / "ckpt")


def assert_fails(completed: subprocess.CompletedProcess, *fragments: str) -> str:
    assert completed.returncode != 0
    lines = error_lines(completed)
    assert len(lines) == 1, completed.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in completed.stderr
    return lines[0]


def test_missing_source_on_s3(s3_prefix, tmp_path):
    destination = tmp_path / "out"
    assert_fails(run_cli("--src", f"{s3_prefix}/nothing", "--dst", str(destination)),
                 f"{s3_prefix}/nothing", "does not exist")
    assert not (destination / "export_manifest.json").exists()


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_missing_local_source_is_named_before_ray_starts(tmp_path, scheme):
    """A mistyped local --src is reported at once: the command, which would start a Ray of its
    own here (no RAY_ADDRESS), exits before starting it."""
    source = f"{scheme}{tmp_path}/no-such-run/actor"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    completed = subprocess.run(
        [sys.executable, "-m", "rayexport.run", "--src", source, "--dst", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert_fails(completed, f"source '{source}' does not exist")
    assert "ray_start" not in completed.stderr and "Started a local Ray" not in completed.stderr
    assert not (tmp_path / "out").exists()


def test_missing_rank_file(broken_copy, tmp_path):
    os.remove(broken_copy / "model_world_size_3_rank_1.pt")
    line = assert_fails(run_main("--src", str(broken_copy), "--dst", str(tmp_path / "out")),
                        "missing rank file", "model_world_size_3_rank_1.pt")
    assert not (tmp_path / "out").exists()
    assert "not committed" not in line  # nothing was written: no export to speak of


def test_world_size_disagrees_with_files(broken_copy, tmp_path):
    (broken_copy / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    assert_fails(run_main("--src", str(broken_copy), "--dst", str(tmp_path / "out")),
                 "world_size 4", "world size 3")


def test_corrupt_rank_file(broken_copy, tmp_path):
    rank_file = broken_copy / "model_world_size_3_rank_2.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    assert_fails(run_main("--src", str(broken_copy), "--dst", str(tmp_path / "out")),
                 "model_world_size_3_rank_2.pt", "cannot be loaded")
    assert not (tmp_path / "out" / "export_manifest.json").exists()


def test_partial_placement_is_refused(checkpoints, tmp_path):
    from support.checkpoints import write_verl_checkpoint
    from support.models import tiny_config

    source = write_verl_checkpoint(tiny_config("qwen2-tied"), str(tmp_path / "ckpt"), world_size=1).path
    subprocess.run(
        [sys.executable, "-c", PARTIAL_WRITER, f"{source}/model_world_size_1_rank_0.pt", str(tmp_path / "pg")],
        check=True, capture_output=True,
    )
    assert_fails(run_main("--src", source, "--dst", str(tmp_path / "out")),
                 "model.norm.weight", "Partial")
    assert not (tmp_path / "out" / "export_manifest.json").exists()


def test_unwritable_destination(checkpoints, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert_fails(run_main("--src", checkpoints["tied"].path, "--dst", str(blocker / "out")), str(blocker / "out"))


def test_unwritable_s3_bucket(s3_checkpoints):
    destination = "s3://no-such-bucket-rayexport/out"
    assert_fails(run_main("--src", s3_checkpoints["tied"], "--dst", destination), destination)
    assert not s3_exists(f"{destination}/export_manifest.json")


def test_debug_shows_the_traceback(tmp_path):
    completed = run_cli("--src", str(tmp_path / "missing"), "--dst", str(tmp_path / "out"), "--debug")
    assert completed.returncode == 1 and "Traceback" in completed.stderr


def test_demo_requires_nothing_else_but_src_and_dst_otherwise():
    completed = run_cli("--src", "/tmp/x")
    assert completed.returncode == 2 and "--src and --dst are required" in completed.stderr


def test_malicious_pickle_is_refused(broken_copy, tmp_path):
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch_file = broken_copy / "model_world_size_3_rank_1.pt"
    import torch

    torch.save({"model.norm.weight": Exploit()}, torch_file, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    assert_fails(run_main("--src", str(broken_copy), "--dst", str(tmp_path / "out")),
                 "model_world_size_3_rank_1.pt", "cannot be loaded")
    assert not (tmp_path / "pwned").exists()


def test_nan_weights_warn_or_fail_under_strict(broken_copy, tmp_path, caplog):
    import torch

    def poison(state):
        norm = state["model.norm.weight"]
        norm._local_tensor = norm._local_tensor.clone()  # its own storage, as training would leave it
        norm._local_tensor[0] = float("nan")

    for rank in range(3):
        path = broken_copy / f"model_world_size_3_rank_{rank}.pt"
        import torch.distributed.tensor  # noqa: F401

        state = torch.load(path, weights_only=True)
        if rank == 1:
            poison(state)
        torch.save(state, path)
    assert_fails(run_main("--src", str(broken_copy), "--dst", str(tmp_path / "strict"), "--strict"),
                 "model.norm.weight", "NaN or Inf")
    assert not list((tmp_path / "strict").glob("*.safetensors"))  # --strict refuses before writing
    with caplog.at_level("WARNING", logger="rayexport"):
        warned = run_main("--src", str(broken_copy), "--dst", str(tmp_path / "warned"), "--verify", "quick")
    assert warned.returncode == 0, warned.stderr[-2000:]
    assert "model.norm.weight' holds NaN or Inf" in caplog.text
    assert (tmp_path / "warned" / "export_manifest.json").exists()


def test_empty_prefix_unknown_scheme_bad_config(broken_copy, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_fails(run_main("--src", str(empty), "--dst", str(tmp_path / "o1")), "is empty")
    assert_fails(run_main("--src", "nosuchscheme://bucket/x", "--dst", str(tmp_path / "o2")), "nosuchscheme://bucket/x")
    (broken_copy / "huggingface" / "config.json").write_text("{not json")
    assert_fails(run_main("--src", str(broken_copy), "--dst", str(tmp_path / "o3")), "config.json", "not valid JSON")


@pytest.mark.parametrize("change, fragments", [
    ({"num_hidden_layers": 3, "layer_types": None}, ("model.layers.2.", "that the config's model needs")),
    ({"intermediate_size": 48}, ("mlp", "global shape [64, 32]", "expects [48, 32]")),
], ids=["missing", "shape"])
def test_config_that_does_not_match_the_weights(broken_copy, tmp_path, change, fragments):
    """The model is described while the workers start; when describing it fails, the workers
    that started meanwhile are removed too."""
    config_path = broken_copy / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(change)
    config_path.write_text(json.dumps({key: value for key, value in config.items() if value is not None}))
    before = {process.pid for process in export_worker_processes()}  # a warm pool's may live on
    assert_fails(run_main("--src", str(broken_copy), "--dst", str(tmp_path / "out")), *fragments)
    assert not workers_left(before)


def test_destination_inside_source(checkpoints):
    assert_fails(run_main("--src", checkpoints["tied"].path, "--dst", checkpoints["tied"].path + "/export"),
                 "is inside source")


@pytest.mark.parametrize("options, fragment", [
    (("--num-gpus-per-worker", "0.5"), "--backend nccl needs a whole GPU per worker; --num-gpus-per-worker 0.5 is not a whole number"),
    (("--num-gpus-per-worker", "0"), "--backend nccl needs a whole GPU per worker; --num-gpus-per-worker 0 gives it none"),
    (("--workers", "2"), "--backend nccl needs 2 GPU(s) (2 worker(s) x 1); the Ray cluster has 0"),
])
def test_nccl_without_a_whole_gpu_per_worker_is_refused_before_any_actor_starts(checkpoints, tmp_path, options, fragment):
    import ray

    groups_before = len(ray.util.placement_group_table())
    assert_fails(run_main("--src", checkpoints["tied"].path, "--dst", str(tmp_path / "out"), "--backend", "nccl", *options),
                 fragment)
    assert len(ray.util.placement_group_table()) == groups_before  # nothing was placed
    assert not (tmp_path / "out" / "export_manifest.json").exists()


def test_secrets_never_reach_logs_report_or_manifest(s3_checkpoints, s3_prefix, tmp_path):
    """A sentinel secret as the S3 credential (moto accepts any), at DEBUG: not in the CLI's
    output, the report, the manifest, or any Ray log of the session."""
    import glob

    from support.helpers import download

    sentinel = "sentinel-secret-7f3a9"
    completed = run_cli(
        "--src", s3_checkpoints["tied"], "--dst", s3_prefix, "--log-level", "DEBUG", "--report", "-", "--verify", "quick",
        "--storage-options", json.dumps({"secret": sentinel}),
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert sentinel not in completed.stdout + completed.stderr
    local = download(s3_prefix, str(tmp_path / "export"))
    assert sentinel not in open(f"{local}/export_manifest.json").read()
    for path in glob.glob("/tmp/ray/session_latest/logs/**/*", recursive=True):
        if os.path.isfile(path):
            with open(path, errors="replace") as handle:
                assert sentinel not in handle.read(), path


# Every command prints an error as one line, whatever the text it embeds: a library's message
# over several lines (transformers, botocore) or a path holding a newline.

def test_export_prints_a_multi_line_cause_on_one_line(broken_copy, tmp_path):
    config_path = broken_copy / "huggingface" / "config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), model_type="no-such-model")))
    completed = run_main("--src", str(broken_copy), "--dst", str(tmp_path / "out"))
    assert completed.returncode == 1
    assert_fails(completed, "no-such-model", "pip install --upgrade transformers")  # the cause's 1st and 3rd line


def test_watch_prints_a_multi_line_cause_on_one_line(tmp_path):
    completed = run_main("--watch", "s3://no such bucket/run7", "--dst-template", str(tmp_path / "{step}"), "--once")
    assert completed.returncode == 1
    assert_fails(completed, "Parameter validation failed: Invalid bucket name")  # botocore's two lines


def test_verify_prints_a_multi_line_message_on_one_line(tmp_path):
    completed = subprocess.run([sys.executable, "-m", "rayexport.verify", str(tmp_path / "exports\nstep7")],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 1
    assert completed.stderr.splitlines() == [assert_fails(completed, "exports step7' is not a committed export")]


def _in_a_terminal(command: list[str], timeout: float = 300) -> tuple[int, str]:
    """Run `command` with a 120-column terminal as its stdout and stderr, as a user's shell
    gives it; its exit status and everything it wrote."""
    import fcntl
    import pty
    import struct
    import termios

    main_end, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, env=dict(os.environ))
    os.close(terminal)
    output = bytearray()
    while True:
        try:
            chunk = os.read(main_end, 65536)
        except OSError:  # the terminal closed: every process writing to it has ended
            break
        if not chunk:
            break
        output += chunk
    os.close(main_end)
    return process.wait(timeout=timeout), output.decode(errors="replace")


@pytest.mark.slow  # writes a checkpoint with gloo ranks and exports it, perhaps starting Ray
def test_the_demo_shows_one_progress_bar_and_no_worker_bars(tmp_path):
    """The README's first command in a terminal: the driver's bar, with every worker's counters,
    and none of the workers' own bars (`load0:`, `write1:`, ...) that Ray would forward."""
    code, output = _in_a_terminal([sys.executable, "-m", "rayexport.run", "--demo", "--dst", str(tmp_path / "out")])
    assert code == 0, output[-3000:]
    assert (tmp_path / "out" / "export_manifest.json").exists()
    drawn = [line for line in output.replace("\r", "\n").splitlines() if line.startswith("reload: ")]
    assert drawn and re.search(r"loaded \d+/\d+ kB, scanned \d+/\d+ kB, sent .*, written .*, verified \d+/\d+ kB", drawn[-1]), drawn
    assert not re.search(r"\b(spool|load|write|verify)\d+:", output), output[-3000:]
