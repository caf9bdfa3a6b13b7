"""Session fixtures: one moto S3 server over HTTP, one local Ray instance, and real FSDP2
checkpoints written by real gloo ranks."""

from __future__ import annotations

import logging
import os
import uuid

import pytest

from helpers import BUCKET, LORA, REMOTE_CODE, remote_code_config, upload

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1; s3fs talks to it over HTTP like any S3 endpoint."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture(scope="session")
def ray_address(s3_endpoint):
    """One local Ray instance for the session (started after the S3 variables are set, so its
    workers see them); CLI subprocesses join it through RAY_ADDRESS. It advertises no GPUs even
    on a GPU machine, so `--backend auto` means gloo here everywhere; the GPU cases start Ray
    of their own (test_gpu_cluster.py, test_gpu.py)."""
    import ray

    ray.init(num_cpus=8, num_gpus=0, include_dashboard=False, logging_level="WARNING")
    address = ray.get_runtime_context().gcs_address
    os.environ["RAY_ADDRESS"] = address
    yield address
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture
def s3_prefix(s3_endpoint):
    """A fresh, empty s3:// prefix."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Real FSDP2 checkpoints: tied Qwen2-style and untied Llama-style at world size 3 (uneven
    shards), and a tied model on a 2x2 ("ddp", "fsdp") HSDP mesh."""
    from rayexport.demo import tiny_config, write_verl_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "tied": write_verl_checkpoint(tiny_config("qwen2-tied"), str(root / "tied"), world_size=3),
        "untied": write_verl_checkpoint(tiny_config("llama-untied"), str(root / "untied"), world_size=3),
        "hsdp": write_verl_checkpoint(
            tiny_config("qwen2-tied"), str(root / "hsdp"), world_size=4, mesh_shape=(2, 2)
        ),
    }


@pytest.fixture(scope="session")
def lora_checkpoints(tmp_path_factory):
    """verl-style LoRA runs: a PeftModel with random adapters saved by FSDP2 ranks, in full and
    adapter-only (with the base model as a separate HF folder); and an adapter-only run of a
    remote-code model, whose code lives only in its base model folder."""
    from rayexport.demo import tiny_config, write_verl_checkpoint

    root = tmp_path_factory.mktemp("lora")
    config = remote_code_config(str(root / "remote-code"))
    return {
        "lora": write_verl_checkpoint(tiny_config("qwen2-tied"), str(root / "lora"), world_size=3, lora=LORA),
        "lora_only": write_verl_checkpoint(
            tiny_config("qwen2-tied"), str(root / "lora-only"), world_size=2, lora=LORA, lora_only=True
        ),
        "remote": write_verl_checkpoint(
            config, str(root / "remote"), world_size=2, lora=LORA, lora_only=True, code_files=REMOTE_CODE
        ),
    }


@pytest.fixture(scope="session")
def s3_checkpoints(checkpoints, s3_endpoint):
    """The same checkpoints uploaded to the S3 server."""
    return {name: upload(written.path, f"s3://{BUCKET}/checkpoints/{name}") for name, written in checkpoints.items()}
