"""The reload check within a memory bound: the streamed reload of an export several times the
bound computes the same logits as `from_pretrained`, keeps the child's peak under the bound,
reads a remote export through the parent (the child has no credentials, nothing is copied
whole), and fails each broken export with the message of the check that catches it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from rayexport.storage.store import Store

from rayexport.storage.settings import storage_options_from_env
from rayexport.verification import VerificationError
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reload.parent import ReloadProcess, check_reload, tensor_table

from support.helpers import upload
from support.models import LORA

# The child's peak above its start-up varies by tens of MB with how much of torch's shared
# libraries the kernel kept resident (up to 85 MB on the 320 MB model in a full run); the bound leaves
# room for that and is still a third of the model.
BOUND = 96 * 2**20
LARGE = 2**34  # a bound every export here fits: the in-memory reload
TIED = [("model.embed_tokens.weight", "lm_head.weight")]
TIMEOUT_S = 600


def write_export(config, folder: str, lora: dict | None = None) -> str:
    """An export as `save_pretrained` writes it (several shards), with a tokenizer and, given
    `lora`, an adapter of random values in lora_adapter/."""
    from peft import LoraConfig, get_peft_model

    from support.models import build_model, write_hf_folder

    write_hf_folder(config, folder)
    model = build_model(config)
    model.save_pretrained(folder, max_shard_size="100MB")
    if lora:
        peft_model = get_peft_model(model, LoraConfig(**lora))
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_()
        peft_model.save_pretrained(os.path.join(folder, "lora_adapter"))
    return folder


@pytest.fixture(scope="module")
def untied_export(tmp_path_factory):
    """A float32 Llama of about 320 MB, five times the bound; no module above 17 MB."""
    from support.models import sized_llama_config

    config = sized_llama_config(320 * 10**6, hidden_size=512, vocab_size=8000, dtype="float32")
    return write_export(config, str(tmp_path_factory.mktemp("untied") / "export"))


@pytest.fixture(scope="module")
def tied_export(tmp_path_factory):
    """A tied float32 Qwen2 of about 220 MB with a LoRA adapter."""
    from support.models import tiny_config

    config = tiny_config(
        "qwen2-tied", vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=16,
        num_attention_heads=8, num_key_value_heads=8,
    )
    return write_export(config, str(tmp_path_factory.mktemp("tied") / "export"), lora=LORA)


def expected(**fields) -> ExpectedExport:
    return ExpectedExport(files={}, tensors={}, **fields)


def tensor_bytes(folder: str) -> int:
    return sum(entry["end"] - entry["start"] for entry in tensor_table(Store(folder)).values())


def above_startup(result: dict) -> int:
    return result["peak_rss_bytes"] - result["startup_rss_bytes"]


def test_streamed_reload_gives_the_in_memory_logits_within_the_bound(untied_export):
    assert tensor_bytes(untied_export) > 3 * BOUND
    in_memory = check_reload(Store(untied_export), expected(), TIMEOUT_S, LARGE)
    streamed = check_reload(Store(untied_export), expected(), TIMEOUT_S, BOUND)
    assert in_memory["mode"] == "in-memory" and streamed["mode"] == "streamed"
    assert streamed["logits_finite"] and streamed["logits_sha256"] == in_memory["logits_sha256"]
    assert streamed["class"] == "LlamaForCausalLM" and streamed["dtype"] == "float32" and streamed["tokenizer"]
    assert above_startup(streamed) < BOUND < above_startup(in_memory)


def test_a_tied_model_streams_with_its_tie_shared_and_its_adapter(tied_export):
    in_memory = check_reload(Store(tied_export), expected(tied=TIED, adapter=True), TIMEOUT_S, LARGE)
    streamed = check_reload(Store(tied_export), expected(tied=TIED, adapter=True), TIMEOUT_S, BOUND)
    assert streamed["mode"] == "streamed" and streamed["untied"] == [] and streamed["adapter_missing"] == []
    assert streamed["logits_sha256"] == in_memory["logits_sha256"]
    assert above_startup(streamed) < BOUND


def test_streamed_reload_from_s3_reads_through_the_parent(tied_export, s3_prefix, monkeypatch):
    """The child gets no storage credentials, so the parent reads each tensor's bytes for it;
    only the small files are copied, never a shard."""
    environments, downloads = [], []
    popen, download = subprocess.Popen, Store.download
    monkeypatch.setattr(subprocess, "Popen", lambda command, **kwargs: environments.append(kwargs["env"]) or popen(command, **kwargs))
    monkeypatch.setattr(Store, "download", lambda store, name, path: downloads.append(name) or download(store, name, path))
    local = check_reload(Store(tied_export), expected(tied=TIED), TIMEOUT_S, BOUND)
    store = Store(upload(tied_export, s3_prefix), storage_options_from_env())
    remote = check_reload(store, expected(tied=TIED), TIMEOUT_S, BOUND)
    assert remote["mode"] == "streamed" and remote["logits_sha256"] == local["logits_sha256"]
    assert above_startup(remote) < BOUND
    assert not any(key.startswith("AWS_") for env in environments for key in env)
    assert "config.json" in downloads and not any(name.startswith("model") and name.endswith(".safetensors") for name in downloads)


@pytest.fixture
def broken(tied_export, tmp_path):
    """A copy of the tied export, to break."""
    return str(shutil.copytree(tied_export, tmp_path / "export"))


def fails(folder: str, *fragments: str, **fields) -> str:
    with pytest.raises(VerificationError) as error:
        check_reload(Store(folder), expected(tied=TIED, **fields), TIMEOUT_S, BOUND)
    message = str(error.value)
    assert all(fragment in message for fragment in fragments) and "\n" not in message, message
    return message


def rewrite_shard(folder: str, key: str, change) -> None:
    """Rewrite the shard holding `key` with `change` applied to its tensors (a dict)."""
    from safetensors.torch import load_file, save_file

    name = tensor_table(Store(folder))[key]["file"]
    tensors = load_file(f"{folder}/{name}")
    change(tensors)
    save_file(tensors, f"{folder}/{name}", metadata={"format": "pt"})


UP_PROJ = "model.layers.3.mlp.up_proj.weight"


def test_a_missing_tensor_fails_the_streamed_reload(broken):
    rewrite_shard(broken, UP_PROJ, lambda tensors: tensors.pop(UP_PROJ))
    fails(broken, "reload: missing keys", UP_PROJ)


def test_a_renamed_or_extra_tensor_fails(broken):
    rewrite_shard(broken, UP_PROJ, lambda tensors: tensors.update({"model.layers.3.mlp.extra.weight": tensors[UP_PROJ][:2].clone()}))
    fails(broken, "reload: unexpected keys", "model.layers.3.mlp.extra.weight")
    rewrite_shard(broken, UP_PROJ, lambda tensors: tensors.update({"model.layers.3.mlp.up.weight": tensors.pop(UP_PROJ)}))
    fails(broken, "reload: missing keys", UP_PROJ)


def test_a_wrong_shape_fails(broken):
    rewrite_shard(broken, UP_PROJ, lambda tensors: tensors.update({UP_PROJ: tensors[UP_PROJ][:-1].clone()}))
    fails(broken, "reload: mismatched keys", UP_PROJ)


def test_corrupted_values_fail_the_forward_pass(broken):
    entry = tensor_table(Store(broken))[UP_PROJ]
    with open(f"{broken}/{entry['file']}", "r+b") as handle:
        handle.seek(entry["start"])
        handle.write(b"\xff" * (entry["end"] - entry["start"]))  # NaN in float32
    fails(broken, "reload: the forward pass gives non-finite logits")


def test_a_truncated_shard_names_the_tensor_it_cuts(broken):
    table = tensor_table(Store(broken))
    last = max(table, key=lambda key: (table[key]["file"] == table[UP_PROJ]["file"], table[key]["end"]))
    with open(f"{broken}/{table[last]['file']}", "r+b") as handle:
        handle.truncate(table[last]["end"] - 100)
    fails(broken, "reload: transformers cannot load the export", f"tensor '{last}'", "ends after")


def test_an_adapter_peft_cannot_place_fails_the_streamed_reload(broken):
    from safetensors.torch import load_file, save_file

    path = f"{broken}/lora_adapter/adapter_model.safetensors"
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key.replace("layers.0.", "layers.99.")] = tensors.pop(key)
    save_file(tensors, path, metadata={"format": "pt"})
    fails(broken, "reload: peft did not load adapter tensor", "layers.", adapter=True)


def test_experts_stacked_from_several_tensors_fall_back_to_the_keys_check(tmp_path):
    """Mixtral's on-disk experts are separate tensors transformers 5 stacks into one parameter:
    the streamed reload declines, the in-memory one runs where the model fits."""
    import transformers

    from support.models import tiny_format_config, write_hf_folder

    config = tiny_format_config("mixtral")
    folder = str(tmp_path / "export")
    write_hf_folder(config, folder)
    transformers.MixtralForCausalLM._from_config(config).save_pretrained(folder)
    assert check_reload(Store(folder), expected(), TIMEOUT_S, LARGE)["mode"] == "in-memory"
    result = check_reload(Store(folder), expected(), TIMEOUT_S, 1)
    assert result["mode"] == "keys-only" and result["logits_finite"] is None and result["missing_keys"] == []
    assert "experts" in result["reason"] and "several on-disk tensors" in result["reason"]


def test_a_module_larger_than_the_bound_falls_back_to_the_keys_check(untied_export):
    result = check_reload(Store(untied_export), expected(), TIMEOUT_S, 8 * 2**20)
    assert result["mode"] == "keys-only" and "model.embed_tokens" in result["reason"]


def test_quick_compares_the_headers_only(broken):
    """The keys check compares the headers with the meta-device model and reads no tensor."""
    entry = tensor_table(Store(broken))[UP_PROJ]
    with open(f"{broken}/{entry['file']}", "r+b") as handle:
        handle.seek(entry["start"])
        handle.write(b"\xff" * (entry["end"] - entry["start"]))
    result = check_reload(Store(broken), expected(tied=TIED, level="quick"), TIMEOUT_S, BOUND)
    assert result["mode"] == "keys-only" and result["missing_keys"] == [] and result["logits_finite"] is None


def test_a_process_started_ahead_checks_as_one_started_for_the_check_and_is_used_up(tied_export, monkeypatch):
    """The reload's process started before the export is written (its imports done while it
    waits) gives the same result as one started for the check, from an environment without the
    credentials the parent had when it started it, with the threads it was given (a Ray worker's
    own are one); after the check it is gone, folder and all."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "must-not-reach-the-child")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    process = ReloadProcess(threads=3)
    environment = process_environment(process.process.pid)
    assert "AWS_SECRET_ACCESS_KEY" not in environment and environment["OMP_NUM_THREADS"] == "3"
    ahead = check_reload(Store(tied_export), expected(tied=TIED), TIMEOUT_S, LARGE, process)
    now = check_reload(Store(tied_export), expected(tied=TIED), TIMEOUT_S, LARGE)
    timing = ("started_at", "imports_s", "waited_s", "startup_rss_bytes", "peak_rss_bytes")
    assert {key: value for key, value in ahead.items() if key not in timing} == {key: value for key, value in now.items() if key not in timing}
    assert ahead["imports_s"] > 0 and ahead["waited_s"] >= 0
    assert process.process.poll() == 0 and not os.path.exists(process.scratch)


def test_a_process_started_ahead_ends_when_its_parent_goes_away_without_a_check():
    """A worker that dies, or ends without a check for its process, closes the channel: the
    child, once its imports are done, exits on its own rather than waiting for ever."""
    process = ReloadProcess()
    process.process.stdin.close()
    assert process.process.wait(timeout=TIMEOUT_S) == 0
    process.close()
    assert not os.path.exists(process.scratch)


def process_environment(pid: int) -> dict[str, str]:
    """The environment the reload's child started with, once it runs the child's module (until
    then /proc shows that of the process it was forked from, or of `nice`)."""
    import time

    def started() -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
        return argv[0] != b"nice" and b"rayexport.verification.reload.child" in argv

    deadline = time.monotonic() + 60
    while not started():
        assert time.monotonic() < deadline, "the reload's child never started"
        time.sleep(0.01)
    with open(f"/proc/{pid}/environ", "rb") as handle:
        return dict(item.split("=", 1) for item in handle.read().decode().split("\0") if "=" in item)


@pytest.mark.parametrize("version, argument", [
    ("4.50.3", "torch_dtype"), ("4.55.4", "torch_dtype"), ("4.56.0.dev0", "dtype"), ("4.56.1", "dtype"), ("5.24.0", "dtype"),
])
def test_the_reload_names_the_dtype_argument_the_installed_transformers_reads(monkeypatch, version, argument):
    """transformers below 4.56 reads `torch_dtype` and keeps `dtype` in the config unread, loading
    a bfloat16 export as float32 (benchmarks/transformers_floor.sh runs the real 4.50)."""
    import transformers

    from rayexport.verification.reload.child import auto_dtype

    monkeypatch.setattr(transformers, "__version__", version)
    assert auto_dtype() == {argument: "auto"}


def test_mapped_files_read_without_a_copy_and_give_the_pages_back(tmp_path):
    """The streamed reload's reader maps the export's files: a tensor is a view of the file's
    pages, which count in the child's memory until released, and a cut file names the tensor."""
    import torch

    from rayexport.common.memory import rss_bytes
    from rayexport.verification.reload.streamed import MappedFiles

    values = torch.arange(32 * 2**20, dtype=torch.int32)  # 128 MiB
    (tmp_path / "model.safetensors").write_bytes(values.numpy().tobytes())
    table = {"w": {"file": "model.safetensors", "dtype": "int32", "shape": [values.numel()], "start": 0, "end": values.nbytes},
             "cut": {"file": "model.safetensors", "dtype": "int32", "shape": [4], "start": values.nbytes - 8, "end": values.nbytes + 8}}
    read = MappedFiles(str(tmp_path), table)
    before = rss_bytes()
    mapped = torch.frombuffer(read("w"), dtype=torch.int32)
    assert torch.equal(mapped, values)
    assert rss_bytes() - before > 100 * 2**20  # the pages read are this process's until released
    read.release()
    assert rss_bytes() - before < 16 * 2**20
    assert torch.equal(mapped, values)  # mapped in again from the page cache when read
    with pytest.raises(EOFError, match="tensor 'cut' in model.safetensors ends after 8 of its 16 bytes"):
        read("cut")
