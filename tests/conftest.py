"""Session fixtures: one moto S3 server over HTTP (and a fault-injecting proxy in front of it),
one local Ray instance, and real FSDP2 checkpoints written by real gloo ranks.

The shared test code is the `support` package beside this file: pytest's default `prepend`
import mode puts this folder (it has no __init__.py) on sys.path, so tests import `support.*`."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import uuid
from concurrent.futures import Future

import pytest

from support.helpers import BUCKET, upload

# The session's Ray head node (`ray_address`), once started.
RAY_HEAD = pytest.StashKey()
# A test that needs any of these (or a fixture that does) is `slow`, which `-m "not slow"` leaves
# out: the session's Ray, its S3 server and the checkpoints gloo ranks write for the session. A
# test slow for another reason (a cluster, a virtualenv, a subprocess export) is marked itself.
SLOW_FIXTURES = frozenset({
    "ray_address", "s3_endpoint", "verl_checkpoints", "hf_sharded_checkpoints", "megatron_checkpoints", "deepspeed_checkpoints",
    "megatron_bridge_checkpoints",
})


def pytest_configure(config):
    """The session saves model descriptions (`rayexport.model.saved`) in a folder of its own,
    removed at its end: never the user's cache, and none from an earlier session."""
    os.environ["RAYEXPORT_CACHE"] = tempfile.mkdtemp(prefix="rayexport-tests-cache-")


def pytest_unconfigure(config):
    shutil.rmtree(os.environ.pop("RAYEXPORT_CACHE", ""), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)

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
def ray_address(s3_endpoint, request):
    """One local Ray instance for the session (started after the S3 variables are set, so its
    workers see them); CLI subprocesses join it through RAY_ADDRESS. It advertises no GPUs even
    on a GPU machine, so `--backend auto` means gloo here everywhere; the GPU cases start Ray
    of their own (test_gpu_cluster.py, test_gpu.py). It starts as the command line starts its
    own (`rayexport.orchestration.session.local_ray_settings`). Where its logs are goes to the terminal."""
    import ray

    from rayexport.orchestration.session import local_ray_settings

    ray.init(num_cpus=8, num_gpus=0, **local_ray_settings("WARNING"))
    address = ray.get_runtime_context().gcs_address
    os.environ["RAY_ADDRESS"] = address
    node = ray._private.worker._global_node  # this process started the head: its processes are our children
    request.config.stash[RAY_HEAD] = node
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line(f"the session's Ray at {address} logs to {node.get_logs_dir_path()}")
    yield address
    del request.config.stash[RAY_HEAD]
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="module")
def warm_pool(ray_address, request):
    """A warm worker pool (`--pool`) for a module's exports whose subject is what they export,
    not how an export starts: exports of one shape share worker actors, reset between them, as a
    training loop's exports do (start-up itself: test_end_to_end.py, test_orchestration_pool.py,
    test_faults.py). Closed when the module ends, so that its idle groups hold no CPUs after it."""
    from rayexport import close_pool

    name = f"tests-{request.module.__name__}"
    yield name
    close_pool(name)


@pytest.fixture(autouse=True)
def ray_head_alive(request):
    """Stop the run, naming the process and how it ended, once a process of the session's Ray
    head (GCS, raylet, its agents) is gone. The driver (this process) would otherwise exit with
    status 1 and no summary: 60 s after its GCS went away, or at its next object-store call
    after its raylet did, with the only message on a stderr that pytest is capturing."""
    _check_ray_head(request.config, f"before {request.node.nodeid}")
    yield
    _check_ray_head(request.config, f"by the end of {request.node.nodeid}")


def _check_ray_head(config, when: str) -> None:
    node = config.stash.get(RAY_HEAD, None)
    if node is None:
        return
    dead = node.dead_processes()
    if dead:
        ended = ", ".join(f"{kind} (pid {process.pid}) {_ended(process.returncode)}" for kind, process in dead)
        pytest.exit(f"the session's Ray head lost {ended} {when}; see {node.get_logs_dir_path()}", returncode=1)


def _ended(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


@pytest.fixture(scope="module")
def proxy(s3_endpoint):
    """A fault-injecting proxy in front of the S3 server (support/fault_proxy.py), one per test
    module; tests `reset()` it to choose the requests it breaks."""
    from support.fault_proxy import FaultProxy

    proxy = FaultProxy(s3_endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def s3_prefix(s3_endpoint):
    """A fresh, empty s3:// prefix."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def verl_checkpoints(tmp_path_factory):
    """Every verl checkpoint the session's tests share, by name, written with one set of gloo
    ranks per world size (starting ranks, each importing transformers, costs far more than
    saving a tiny model); `checkpoints` and `lora_checkpoints` hand them out."""
    from transformers import GPT2Config

    from support.checkpoints import VerlJob, write_verl_checkpoints
    from support.models import LORA, REMOTE_CODE, remote_code_config, tiny_config

    root = tmp_path_factory.mktemp("verl")
    gpt2 = GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128, dtype="float32")
    gpt2.architectures = ["GPT2LMHeadModel"]
    critic = tiny_config("qwen2-tied", num_labels=1, id2label={0: "value"})  # verl's critic: a value per token
    critic.architectures = ["Qwen2ForTokenClassification"]
    return write_verl_checkpoints({
        "tied": VerlJob(tiny_config("qwen2-tied"), str(root / "tied"), world_size=3),
        "untied": VerlJob(tiny_config("llama-untied"), str(root / "untied"), world_size=3),
        "critic": VerlJob(critic, str(root / "critic"), world_size=3),
        "hsdp": VerlJob(tiny_config("qwen2-tied"), str(root / "hsdp"), world_size=4, mesh_shape=(2, 2)),
        "lora": VerlJob(tiny_config("qwen2-tied"), str(root / "lora"), world_size=3, lora=LORA),
        "lora_only": VerlJob(tiny_config("qwen2-tied"), str(root / "lora-only"), world_size=2, lora=LORA, lora_only=True),
        "remote": VerlJob(
            remote_code_config(str(root / "remote-code")), str(root / "remote"), world_size=2, lora=LORA,
            lora_only=True, code_files=REMOTE_CODE,
        ),
        # GPT-2's Conv1D stores weights (in, out); attn.c_proj is square, so its shape cannot
        # tell the orientation
        "gpt2_lora": VerlJob(
            gpt2, str(root / "gpt2-lora"), world_size=3, lora={"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_proj", "c_fc"]},
        ),
    })


@pytest.fixture(scope="session")
def checkpoints(verl_checkpoints):
    """Real FSDP2 checkpoints: tied Qwen2-style and untied Llama-style at world size 3 (uneven
    shards), and a tied model on a 2x2 ("ddp", "fsdp") HSDP mesh."""
    return {name: verl_checkpoints[name] for name in ("tied", "untied", "hsdp")}


@pytest.fixture(scope="session")
def lora_checkpoints(verl_checkpoints):
    """verl-style LoRA runs: a PeftModel with random adapters saved by FSDP2 ranks, in full and
    adapter-only (with the base model as a separate HF folder); an adapter-only run of a
    remote-code model, whose code lives only in its base model folder; and a GPT-2 run with
    adapters on every Conv1D."""
    return {name: verl_checkpoints[name] for name in ("lora", "lora_only", "remote", "gpt2_lora")}


@pytest.fixture(scope="session")
def dcp_checkpoints(tmp_path_factory):
    """The session's DCP checkpoints (`WrittenDcp`s), all saved by one set of 3 FSDP2 gloo ranks:
    a tied Qwen2 nested under "model." with an optimizer state beside it, an untied Llama flat at
    the top level and nested under "app.model.", and an untied Qwen2 saved through
    torch.compile's wrapper (every key under `_orig_mod.`)."""
    from support.checkpoints import DcpJob, WrittenDcp, write_dcp_checkpoints
    from support.models import tiny_config

    root = tmp_path_factory.mktemp("dcp")
    untied_qwen2 = tiny_config("qwen2-tied")
    untied_qwen2.tie_word_embeddings = False
    jobs = {
        "tied": DcpJob(tiny_config("qwen2-tied"), str(root / "tied"), "model.", with_optimizer=True),
        "flat": DcpJob(tiny_config("llama-untied"), str(root / "flat"), ""),
        "app": DcpJob(tiny_config("llama-untied"), str(root / "app"), "app.model.", with_optimizer=True),
        "compiled-untied": DcpJob(untied_qwen2, str(root / "compiled-untied"), compiled=True),
    }
    written = write_dcp_checkpoints(list(jobs.values()), world_size=3)
    return {
        name: WrittenDcp(job.out_dir, job.prefix, job.with_optimizer, reference, logits)
        for (name, job), (logits, reference) in zip(jobs.items(), written)
    }


@pytest.fixture(scope="session")
def hf_sharded_checkpoints(tmp_path_factory):
    """torch's sharded HF safetensors of two models, written by one set of 2 gloo ranks: as
    torchtitan's `last_save_in_hf` leaves them (`titan/step-10/sharded/`, a tied Qwen2 with
    uneven shards, its config in `titan-hf/`) and as NeMo Automodel saves them
    (`automodel/epoch_0_step_10/model/`, config in its `.hf_metadata/`)."""
    from support.hf_sharded import ShardedJob, write_hf_sharded_checkpoints
    from support.models import tiny_config, write_hf_folder

    root = tmp_path_factory.mktemp("hf-sharded")
    titan = ShardedJob(tiny_config("qwen2-tied", vocab_size=1001), str(root / "titan" / "step-10" / "sharded"))
    automodel = ShardedJob(tiny_config("llama-untied"), str(root / "automodel" / "epoch_0_step_10" / "model"), seed=1)
    written = write_hf_sharded_checkpoints([titan, automodel], world_size=2)
    write_hf_folder(titan.config, str(root / "titan-hf"))
    write_hf_folder(automodel.config, f"{automodel.out_dir}/.hf_metadata")
    return {"titan": written[0], "automodel": written[1], "titan-hf": str(root / "titan-hf")}


@pytest.fixture(scope="session")
def s3_checkpoints(checkpoints, s3_endpoint):
    """The same checkpoints uploaded to the S3 server."""
    return {name: upload(written.path, f"s3://{BUCKET}/checkpoints/{name}") for name, written in checkpoints.items()}


def _write_megatron(root: str) -> dict[str, str]:
    from support.megatron_checkpoints import write_megatron_checkpoints

    return write_megatron_checkpoints(root)


def _write_megatron_bridge(root: str) -> dict[str, str]:
    from support.megatron_bridge_checkpoints import write_megatron_bridge_checkpoints
    from support.megatron_bridge_registry_checkpoints import write_registry_checkpoints

    built = write_megatron_bridge_checkpoints(os.path.join(root, "built"))
    return {**built, **write_registry_checkpoints(os.path.join(root, "registry"))}


def _write_deepspeed(root: str) -> dict[str, str]:
    from support.deepspeed_checkpoints import write_deepspeed_checkpoints

    return write_deepspeed_checkpoints(root)


# The other trainers' saves, each written by its own package in a process of its own (a minute
# or more each), in the order the tests need them: fixture name, folder, writer.
SAVES = (
    ("deepspeed_checkpoints", "deepspeed", _write_deepspeed), ("megatron_checkpoints", "megatron", _write_megatron),
    ("megatron_bridge_checkpoints", "megatron-bridge", _write_megatron_bridge),
)


@pytest.fixture(scope="session", autouse=True)
def saves_written_ahead(request, tmp_path_factory):
    """By fixture name, a future of each save the session's tests need, written one after the
    other in a thread from the session's start, so that the tests before them run meanwhile.
    The session waits for any still being written before it ends, so no writer outlives it."""
    needed = [(name, folder, write) for name, folder, write in SAVES
              if any(name in item.fixturenames for item in request.session.items)]
    futures = {name: Future() for name, _, _ in needed}

    def write_all():
        for name, folder, write in needed:
            try:
                futures[name].set_result(write(str(tmp_path_factory.mktemp(folder))))
            except BaseException as error:  # noqa: BLE001 - handed to the test that needs it
                futures[name].set_exception(error)

    # pytest makes its base temporary folder on first use, without a lock: made here first, so
    # that this thread and the tests' own tmp_path calls cannot each make one.
    tmp_path_factory.getbasetemp()
    writer = threading.Thread(target=write_all, name="saves-written-ahead", daemon=True)
    writer.start()
    yield futures
    writer.join()


@pytest.fixture(scope="session")
def megatron_checkpoints(saves_written_ahead):
    """Real Megatron-Core torch_dist checkpoints, by name (`support.megatron_checkpoints.CASES`),
    which the Megatron, node-local and vLLM tests share."""
    return saves_written_ahead["megatron_checkpoints"].result()


@pytest.fixture(scope="session")
def megatron_bridge_checkpoints(saves_written_ahead):
    """Real Megatron-Core torch_dist checkpoints written by Megatron-Bridge 0.6.2, by name
    (`support.megatron_bridge_checkpoints.CASES`, `support.megatron_bridge_registry_checkpoints.REGISTRY_CASES`)."""
    return saves_written_ahead["megatron_bridge_checkpoints"].result()


@pytest.fixture(scope="session")
def deepspeed_checkpoints(saves_written_ahead):
    """Real DeepSpeed ZeRO checkpoints, by name (`support.deepspeed_checkpoints.CASES`)."""
    return saves_written_ahead["deepspeed_checkpoints"].result()
