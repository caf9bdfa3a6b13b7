"""Helpers the tests share: running the CLI as a user does, moving folders to and from S3,
and reloading an export in a fresh process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time

BUCKET = "rayexport-tests"


def folder_with(root, files: dict[str, str | bytes]):
    """A local folder holding `files` (relative name -> contents), as a rayexport Store."""
    from rayexport.storage.store import Store

    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    return Store(str(root))


def upload(local_dir: str, uri: str) -> str:
    """Copy a local checkpoint folder to S3."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.put(local_dir.rstrip("/") + "/", uri.removeprefix("s3://").rstrip("/") + "/", recursive=True)
    return uri


def download(uri: str, local_dir: str) -> str:
    """Copy an S3 prefix to a local folder."""
    import s3fs

    s3fs.S3FileSystem().get(uri.removeprefix("s3://").rstrip("/") + "/", local_dir.rstrip("/") + "/", recursive=True)
    return local_dir


def s3_exists(uri: str) -> bool:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return fs.exists(uri.removeprefix("s3://"))


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m rayexport.run ARGS` as a user runs it, joined to the session's Ray instance."""
    return subprocess.run(
        [sys.executable, "-m", "rayexport.run", *args],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )


def run_main(*args: str) -> subprocess.CompletedProcess:
    """The CLI's `main(ARGS)` in this process (joined to the session's Ray): its exit code and
    what it printed, shaped like `run_cli`'s result."""
    from rayexport.run import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def exported_tensors(folder) -> dict:
    """Every tensor of the safetensors files in an export folder, by name."""
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def reload(path: str) -> dict:
    """Reload an export with transformers in this process; return its logits on the demo
    prompt (as a tensor), their dtype, and whether the head shares the embedding's memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from support.models import PROMPT_IDS

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT_IDS)).logits
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    return {"logits": logits, "dtype": str(logits.dtype), "shared": head.data_ptr() == embed.data_ptr()}


def reload_in_fresh_process(path: str, trust_remote_code: bool = False) -> dict:
    """`reload` in a new Python process started in an empty folder with an empty module cache,
    as a user loading the export elsewhere would."""
    import tempfile

    import torch

    from support.models import PROMPT_IDS

    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"PROMPT_IDS = {PROMPT_IDS!r}\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=sys.argv[2] == '1').eval()\n"
        "with torch.no_grad(): logits = model(input_ids=torch.tensor(PROMPT_IDS)).logits\n"
        "head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight\n"
        "print(json.dumps({'logits': logits.tolist(), 'dtype': str(logits.dtype),\n"
        "                  'shared': head.data_ptr() == embed.data_ptr()}))\n"
    )
    with tempfile.TemporaryDirectory() as empty:
        environment = dict(os.environ, HF_MODULES_CACHE=empty, HF_HUB_OFFLINE="1")
        completed = subprocess.run(
            [sys.executable, "-c", code, path, "1" if trust_remote_code else "0"],
            capture_output=True, text=True, timeout=300, cwd=empty, env=environment,
        )
    if completed.returncode != 0:
        raise AssertionError(f"reload failed: {completed.stderr[-2000:]}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return dict(result, logits=torch.tensor(result["logits"]))


def error_lines(completed: subprocess.CompletedProcess) -> list[str]:
    """The `rayexport:` lines of a command's stderr, without the workers' progress bars and
    log lines that Ray forwards there."""
    return [line for line in completed.stderr.splitlines() if line.startswith("rayexport:")]


def workers_left(before: set[int], within_s: float = 10) -> set[int]:
    """The pids of export workers not in `before` still running after up to `within_s` seconds
    (ray.kill returns before the actor's process has ended)."""
    deadline = time.monotonic() + within_s
    while True:
        left = {process.pid for process in export_worker_processes()} - before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def export_worker_processes(address: str | None = None) -> list:
    """The processes of rayexport's worker actors in this test session's Ray (`address`, default
    the RAY_ADDRESS the `ray_address` fixture sets) that still run: their pids come from that
    Ray's actor table, so workers of another Ray on this machine (a second checkout's, a
    benchmark's) are never listed. Ray's state API (`ray.util.state`) needs the dashboard, which
    the session's Ray runs without; its GCS actor table gives the same pids."""
    import psutil
    import ray
    from ray._private import state

    address = address or os.environ["RAY_ADDRESS"]
    connected = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    assert connected == address, f"this process is joined to Ray at {connected}, not the session's {address}"
    pids = {actor["Pid"] for actor in state.actors().values() if actor["ActorClassName"] == "ExportWorkerActor" and actor["Pid"]}
    processes = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            # the pid of an actor Ray reported dead may have been given to another process since
            if process.status() != psutil.STATUS_ZOMBIE and "ray::ExportWorker" in " ".join(process.cmdline()):
                processes.append(process)
        except psutil.Error:
            continue
    return processes
