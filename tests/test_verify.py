"""`rayexport.verify` on a committed export: verification catches each way a real export goes
wrong; each test asserts the message of the check that must catch it, so removing that check
fails the test."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from rayexport.common.errors import ExportError
from rayexport.verification import VerificationError
from rayexport.verify import verify_uri

SHARD_1 = "model-00001-of-00003.safetensors"


@pytest.fixture(scope="module")
def committed(checkpoints, ray_address, tmp_path_factory):
    """One committed export of the tied checkpoint, in three shard files."""
    from rayexport import export

    destination = str(tmp_path_factory.mktemp("verify") / "export")
    report = export(checkpoints["tied"].path, destination, workers=2, max_shard_size="60KB", verify="full", dtype="float32")
    assert len([name for name in report.files if name.startswith("model-")]) == 3
    return destination


@pytest.fixture
def export_copy(committed, tmp_path):
    return str(shutil.copytree(committed, tmp_path / "export"))


def manifest_of(folder):
    with open(f"{folder}/export_manifest.json") as handle:
        return json.load(handle)


def save_manifest(folder, manifest):
    with open(f"{folder}/export_manifest.json", "w") as handle:
        json.dump(manifest, handle)


def rewrite_recorded(folder, name, data: bytes):
    """Replace a file and its recorded size and digest, as a consistent writer bug would."""
    from rayexport.common.digests import FAST, digest_of

    with open(f"{folder}/{name}", "wb") as handle:
        handle.write(data)
    manifest = manifest_of(folder)
    manifest["files"][name] = {"size": len(data), FAST: digest_of(data)}
    save_manifest(folder, manifest)


def fails(folder, *fragments, level="full"):
    with pytest.raises(VerificationError) as error:
        verify_uri(folder, level)
    for fragment in fragments:
        assert fragment in str(error.value)
    return str(error.value)


def test_a_committed_export_verifies(export_copy):
    result = verify_uri(export_copy)
    assert result["passed"] and result["checks"]["fidelity"]["pieces_checked"] > 0
    assert result["checks"]["reload"]["untied"] == [] and result["checks"]["reload"]["logits_finite"]


def test_no_manifest_is_not_a_committed_export(export_copy):
    os.remove(f"{export_copy}/export_manifest.json")
    with pytest.raises(ExportError, match="not a committed export"):
        verify_uri(export_copy)


def test_flipped_byte_fails_the_file_digest(export_copy):
    path = f"{export_copy}/{SHARD_1}"
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x01
    open(path, "wb").write(bytes(data))
    fails(export_copy, "integrity", SHARD_1, "xxh3_128")


def as_written_before_the_fast_digest(folder):
    """Rewrite the export's manifest as rayexport wrote it before the fast digest (format
    rayexport/1: SHA-256 of every file, tensor and source piece under "sha256", no `digest`)."""
    import hashlib

    import torch

    from rayexport.transport.writer import tensor_bytes

    manifest = manifest_of(folder)
    tensors = {key: value for name in os.listdir(folder) if name.startswith("model-")
               for key, value in load_file(f"{folder}/{name}").items()}
    for name, record in manifest["files"].items():
        manifest["files"][name] = {"size": record["size"], "sha256": hashlib.sha256(open(f"{folder}/{name}", "rb").read()).hexdigest()}
    for key, record in manifest["tensors"].items():
        record["sha256"] = hashlib.sha256(tensor_bytes(tensors[key])).hexdigest()
        del record["xxh3_128"]
    for key, pieces in manifest["source_pieces"].items():
        for piece in pieces:
            value, offset, shape = tensors[key], piece["offset"], piece["shape"]
            if len(offset) == 1 and value.dim() != 1:  # a run of the flattened tensor
                region = value.reshape(-1)[offset[0]:offset[0] + shape[0]]
            else:
                region = value[tuple(slice(start, start + length) for start, length in zip(offset, shape))]
            piece["sha256"] = hashlib.sha256(tensor_bytes(torch.as_tensor(region))).hexdigest()
            del piece["xxh3_128"]
    manifest["format"] = "rayexport/1"
    del manifest["digest"]
    save_manifest(folder, manifest)


def test_a_manifest_written_before_the_fast_digest_is_checked_with_sha256(export_copy):
    """`rayexport verify` reads the manifests exports wrote before and after the fast digest:
    SHA-256 records pass where the bytes match, and a flipped byte still fails, naming SHA-256."""
    as_written_before_the_fast_digest(export_copy)
    result = verify_uri(export_copy)
    assert result["passed"] and result["checks"]["fidelity"]["pieces_checked"] > 0
    path = f"{export_copy}/{SHARD_1}"
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x01
    open(path, "wb").write(bytes(data))
    fails(export_copy, "integrity", SHARD_1, "sha256")


def test_truncated_shard_cannot_be_parsed(export_copy):
    path = f"{export_copy}/{SHARD_1}"
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    fails(export_copy, "structure", SHARD_1, "cannot be parsed")


def test_dropped_shard_is_missing(export_copy):
    os.remove(f"{export_copy}/{SHARD_1}")
    fails(export_copy, "structure", SHARD_1, "missing")


def test_index_pointing_outside_the_export_is_refused(export_copy):
    index_path = f"{export_copy}/model.safetensors.index.json"
    index = json.load(open(index_path))
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../evil.safetensors"
    json.dump(index, open(index_path, "w"))
    fails(export_copy, "structure", "invalid shard file", "../evil.safetensors")


def test_duplicate_key_across_shards(export_copy):
    index = json.load(open(f"{export_copy}/model.safetensors.index.json"))
    first_shard = load_file(f"{export_copy}/{SHARD_1}")
    other = sorted(set(index["weight_map"].values()) - {SHARD_1})[0]
    tensors = load_file(f"{export_copy}/{other}")
    key = next(iter(first_shard))
    tensors[key] = first_shard[key]
    save_file(tensors, f"{export_copy}/{other}", metadata={"format": "pt"})
    fails(export_copy, "structure", key, "in both")


def swap_same_shaped(folder):
    """Swap the data of two same-shaped tensors in one shard, with consistent file digests."""
    for name in sorted(n for n in os.listdir(folder) if n.startswith("model-")):
        tensors = load_file(f"{folder}/{name}")
        by_shape = {}
        for key, tensor in sorted(tensors.items()):
            by_shape.setdefault((tuple(tensor.shape), tensor.dtype), []).append(key)
        pairs = [keys for keys in by_shape.values() if len(keys) > 1]
        for first, second in (keys[:2] for keys in pairs):
            if not tensors[first].equal(tensors[second]):
                tensors[first], tensors[second] = tensors[second], tensors[first]
                from safetensors.torch import save

                rewrite_recorded(folder, name, save(tensors, metadata={"format": "pt"}))
                return first, second
    raise AssertionError("no two different same-shaped tensors")


def test_swapped_tensors_fail_the_tensor_digests(export_copy):
    first, second = swap_same_shaped(export_copy)
    message = fails(export_copy, "integrity", "does not match its recorded digest")
    assert first in message or second in message


def test_swapped_tensors_fail_fidelity_even_with_consistent_digests(export_copy):
    """An exporter that wrote the wrong tensor under a name and recorded its digest: only the
    comparison with the source pieces can tell."""
    from rayexport.common.digests import FAST, digest_of
    from rayexport.transport.writer import tensor_bytes

    first, second = swap_same_shaped(export_copy)
    manifest = manifest_of(export_copy)
    for name in [n for n in os.listdir(export_copy) if n.startswith("model-")]:
        for key, tensor in load_file(f"{export_copy}/{name}").items():
            manifest["tensors"][key][FAST] = digest_of(tensor_bytes(tensor))
    save_manifest(export_copy, manifest)
    message = fails(export_copy, "fidelity", "differs from rank")
    assert first in message or second in message


def test_quick_checks_a_sample_and_loads_no_weights(export_copy):
    result = verify_uri(export_copy, "quick")
    assert result["level"] == "quick" and result["checks"]["reload"]["logits_finite"] is None
    assert 0 < result["checks"]["tensors"]["digests_checked"] <= 16


def test_remote_code_runs_without_storage_credentials(export_copy, tmp_path, monkeypatch):
    """The reload imports the export's code; it must not see the AWS variables the verifier has."""
    seen = tmp_path / "seen.txt"
    code = (
        "import os\n"
        "from transformers import Qwen2ForCausalLM\n"
        f"open({str(seen)!r}, 'w').write(repr(sorted(k for k in os.environ if k.startswith('AWS_'))))\n\n\n"
        "class SpyForCausalLM(Qwen2ForCausalLM):\n"
        "    pass\n"
    )
    rewrite_recorded(export_copy, "modeling_spy.py", code.encode())
    config = json.load(open(f"{export_copy}/config.json"))
    config.update(architectures=["SpyForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_spy.SpyForCausalLM"})
    rewrite_recorded(export_copy, "config.json", json.dumps(config).encode())
    manifest = manifest_of(export_copy)
    manifest["options"]["trust_remote_code"] = True
    save_manifest(export_copy, manifest)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sentinel-secret-do-not-leak")
    result = verify_uri(export_copy)
    assert result["checks"]["reload"]["class"] == "SpyForCausalLM"
    assert seen.read_text() == "[]"


def test_verify_cli_exit_codes(export_copy):
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "rayexport.verify", export_copy, "--level", "quick"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "verified" in ok.stdout
    os.remove(f"{export_copy}/export_manifest.json")
    missing = subprocess.run([sys.executable, "-m", "rayexport.verify", export_copy], capture_output=True, text=True)
    assert missing.returncode == 1 and "not a committed export" in missing.stderr


def test_a_tokenizer_class_transformers_lacks_fails_the_reload(export_copy):
    path = f"{export_copy}/tokenizer_config.json"
    settings = dict(json.load(open(path)), tokenizer_class="BogusTokenizer")
    rewrite_recorded(export_copy, "tokenizer_config.json", json.dumps(settings).encode())
    for level in ("full", "quick"):
        message = fails(export_copy, "reload", "tokenizer_config.json", "'BogusTokenizer'", level=level)
        assert "\n" not in message


def test_the_reload_reports_the_tokenizer_and_dtype_it_loaded(export_copy):
    reload = verify_uri(export_copy)["checks"]["reload"]
    assert reload["tokenizer"] and reload["dtype"] == "float32"


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # square, LoRA-merged, in the quick sample


@pytest.fixture(scope="module")
def lora_committed(lora_checkpoints, ray_address, tmp_path_factory):
    """One committed export of the LoRA checkpoint (q_proj and v_proj merged), in bfloat16."""
    from rayexport import export

    destination = str(tmp_path_factory.mktemp("verify-lora") / "export")
    export(lora_checkpoints["lora"].path, destination, workers=2, verify="full")
    return destination


def rewrite_merged(folder, written, bug):
    """Rewrite Q_PROJ as a merge gone wrong would have written it, recording its digests as a
    consistent exporter would: the delta transposed, its scale doubled, or another layer's."""
    from rayexport.common.digests import FAST, digest_of
    from safetensors.torch import save

    from rayexport.transport.writer import tensor_bytes

    def delta(module):
        a, b = (written.adapter_state[f"base_model.model.{module}.lora_{which}.weight"] for which in "AB")
        return 8 / 4 * (b @ a)  # lora_alpha / r

    right = delta(Q_PROJ.removesuffix(".weight"))
    wrong = {
        "transposed": right.T, "scale": 2 * right, "other layer's adapter": delta("model.layers.1.self_attn.q_proj"),
    }[bug]
    tensors = load_file(f"{folder}/model.safetensors")
    tensors[Q_PROJ] = (written.reference_state[Q_PROJ] - right + wrong).to(tensors[Q_PROJ].dtype)
    rewrite_recorded(folder, "model.safetensors", save(tensors, metadata={"format": "pt"}))
    manifest = manifest_of(folder)
    manifest["tensors"][Q_PROJ][FAST] = digest_of(tensor_bytes(tensors[Q_PROJ]))
    save_manifest(folder, manifest)


@pytest.mark.parametrize("level", ["full", "quick"])
@pytest.mark.parametrize("bug", ["transposed", "scale", "other layer's adapter"])
def test_a_wrong_lora_merge_fails_fidelity(lora_committed, lora_checkpoints, tmp_path, bug, level):
    """Each worker merges its own shard of the base weight with the adapter read from the
    source, so a merge the exporter got wrong and recorded consistently still shows."""
    from rayexport.verification.expected import ExpectedExport

    folder = str(shutil.copytree(lora_committed, tmp_path / "export"))
    assert verify_uri(folder, level)["passed"]
    assert Q_PROJ in ExpectedExport.from_manifest(manifest_of(folder), level).sample()
    rewrite_merged(folder, lora_checkpoints["lora"], bug)
    message = fails(folder, f"fidelity: tensor '{Q_PROJ}'", "merged with its LoRA adapter", level=level)
    assert "\n" not in message


def test_full_reads_every_byte_back_once_and_quick_only_headers_and_the_sample(export_copy):
    """The checks read the destination by byte ranges: `full` streams each file once (its
    digest, every tensor's digest and every source piece from the same pass), `quick` reads the
    small files and the sampled tensors' bytes, nothing else of the weights."""
    from rayexport.storage.store import Store
    from rayexport.verification.expected import ExpectedExport
    from rayexport.verification.reading import read_header

    manifest = manifest_of(export_copy)
    sizes = {name: record["size"] for name, record in manifest["files"].items()}
    full = verify_uri(export_copy, "full")["checks"]
    assert full["files"]["bytes_read"] == sum(sizes.values())
    assert full["tensors"]["digests_checked"] == len(manifest["tensors"])

    quick = verify_uri(export_copy, "quick")["checks"]
    store, sample = Store(export_copy), ExpectedExport.from_manifest(manifest, "quick").sample()
    sampled = 0
    for name in (name for name in sizes if name.endswith(".safetensors")):
        header = read_header(store, name)[1]
        sampled += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for key, entry in header.items() if key in sample)
    small = sum(size for name, size in sizes.items() if not name.endswith(".safetensors"))
    assert quick["files"]["bytes_read"] == small + sampled < sum(sizes.values()) / 2


def test_each_writer_checks_only_the_files_it_was_given(export_copy):
    """What a writer runs on its own files: a corruption in one shard shows in that shard's
    check alone, and the structure check, which puts the writers' findings together, reports it."""
    from rayexport.storage.store import Store
    from rayexport.verification.expected import ExpectedExport
    from rayexport.verification.files import check_files
    from rayexport.verification.structure import conclude

    path = f"{export_copy}/{SHARD_1}"
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x01
    open(path, "wb").write(bytes(data))
    expected = ExpectedExport.from_manifest(manifest_of(export_copy), "full")
    store = Store(export_copy)
    mine = check_files(store, [SHARD_1], expected)
    others = check_files(store, sorted(set(expected.files) - {SHARD_1}), expected)
    assert all(not check.problems for check in others)
    assert mine[0].problems[0] == f"integrity: file {SHARD_1} does not match its recorded xxh3_128 digest"
    with pytest.raises(VerificationError, match=f"integrity: file {SHARD_1} does not match"):
        conclude(store, others + mine, expected)
