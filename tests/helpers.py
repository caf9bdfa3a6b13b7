"""Helpers the tests share: running the CLI as a user does, moving folders to and from S3,
and reloading an export in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BUCKET = "rayexport-tests"


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


def reload_logits(path: str) -> dict:
    """Reload an export in a fresh process with transformers; return its logits on the demo
    prompt and whether the head shares the embedding's memory."""
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from rayexport.demo import PROMPT_IDS\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "with torch.no_grad(): logits = model(input_ids=torch.tensor(PROMPT_IDS)).logits\n"
        "head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight\n"
        "print(json.dumps({'logits': logits.tolist(), 'dtype': str(logits.dtype),\n"
        "                  'shared': head.data_ptr() == embed.data_ptr()}))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])
