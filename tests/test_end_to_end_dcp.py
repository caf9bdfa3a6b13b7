"""PyTorch DCP checkpoints (FSDP2 gloo ranks, world size 3) through the CLI, S3 to S3, with 2
workers: one plan, two readers."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from support.helpers import download, error_lines, reload, run_main, s3_exists, upload

pytestmark = pytest.mark.usefixtures("ray_address")


@pytest.fixture(scope="module")
def dcp_checkpoints(dcp_checkpoints, s3_endpoint):
    """The session's DCP checkpoints, each also uploaded to the S3 server."""
    return {
        name: {"local": written.path, "uri": upload(written.path, f"s3://rayexport-tests/dcp/{name}"), "logits": written.logits}
        for name, written in dcp_checkpoints.items()
    }


@pytest.mark.parametrize("name", ["tied", "flat"])
def test_dcp_export_matches_the_original(dcp_checkpoints, s3_prefix, tmp_path, name, warm_pool):
    checkpoint = dcp_checkpoints[name]
    report_path = tmp_path / "report.json"
    completed = run_main("--src", checkpoint["uri"], "--dst", s3_prefix, "--workers", "2", "--report", str(report_path), "--dtype", "float32",
                         "--pool", warm_pool, *(["--verify", "none"] if name == "flat" else []))
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["layout"] == "dcp" and report["workers"] == 2 and report["world_size"] == 3
    if name == "tied":
        assert report["skipped"] and all(key.startswith("optim") for key in report["skipped"])
    local = download(s3_prefix, str(tmp_path / "export"))
    reloaded = reload(local)
    torch.testing.assert_close(reloaded["logits"], checkpoint["logits"], rtol=1e-5, atol=1e-6)
    assert reloaded["shared"] is (name == "tied")


def test_config_from_hf_config_when_the_prefix_has_none(dcp_checkpoints, s3_prefix, tmp_path):
    source = shutil.copytree(dcp_checkpoints["flat"]["local"], tmp_path / "ckpt")
    shutil.move(source / "huggingface", tmp_path / "hf")
    src = upload(str(source), f"{s3_prefix}-src")
    refused = run_main("--src", src, "--dst", s3_prefix)
    assert refused.returncode == 1 and "--hf-config" in refused.stderr
    hf = upload(str(tmp_path / "hf"), f"{s3_prefix}-hf")
    completed = run_main("--src", src, "--dst", s3_prefix, "--hf-config", hf, "--verify", "quick")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert s3_exists(f"{s3_prefix}/export_manifest.json") and s3_exists(f"{s3_prefix}/tokenizer.json")


@pytest.mark.parametrize("damage, fragment", [
    (lambda folder: os.remove(folder / ".metadata"), ".metadata"),
    (lambda folder: (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes()[:100]), ".metadata"),
], ids=["metadata-missing", "metadata-truncated"])
def test_broken_metadata(dcp_checkpoints, tmp_path, damage, fragment):
    source = shutil.copytree(dcp_checkpoints["flat"]["local"], tmp_path / "ckpt")
    damage(source)
    completed = run_main("--src", str(source), "--dst", str(tmp_path / "out"))
    assert completed.returncode == 1 and fragment in completed.stderr, completed.stderr[-2000:]
    assert not (tmp_path / "out" / "export_manifest.json").exists()


def test_dcp_keys_that_do_not_match_the_config(dcp_checkpoints, tmp_path):
    source = shutil.copytree(dcp_checkpoints["flat"]["local"], tmp_path / "ckpt")
    shutil.rmtree(source / "huggingface")
    shutil.copytree(dcp_checkpoints["tied"]["local"] + "/huggingface", source / "huggingface")
    completed = run_main("--src", str(source), "--dst", str(tmp_path / "out"), "--layout", "dcp")
    assert completed.returncode == 1
    errors = error_lines(completed)
    assert len(errors) == 1 and errors[0].startswith("rayexport: error:") and "config" in errors[0]
    assert not (tmp_path / "out" / "export_manifest.json").exists()



def test_tied_copies_read_by_two_workers_are_still_compared(dcp_checkpoints, tmp_path):
    """A torch.compile'd model saves every key under `_orig_mod.`; the embedding and the tied
    head, the two largest tensors, go to different workers. The tie used to be missed there, the
    pair skipped and taken as equal, and a head trained apart from the embedding dropped."""
    source = shutil.copytree(dcp_checkpoints["compiled-untied"]["local"], tmp_path / "ckpt")
    config = json.loads((source / "huggingface" / "config.json").read_text())
    (source / "huggingface" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    completed = run_main("--src", str(source), "--dst", str(tmp_path / "out"), "--workers", "2", "--verify", "none")
    assert completed.returncode == 1, completed.stderr[-2000:]
    assert "tied tensors 'model.embed_tokens.weight' and 'lm_head.weight' differ" in completed.stderr
    assert not (tmp_path / "out" / "export_manifest.json").exists()


def accelerate_checkpoint(dcp_checkpoint: str, folder, models: int = 1):
    """A Trainer checkpoint folder as accelerate's `save_state` under FSDP's sharded state dict
    leaves it: the model as DCP in `pytorch_model_fsdp_<i>/` (one per model), the optimizer in
    `optimizer_0/`, and config and tokenizer files beside them."""
    for index in range(models):
        shutil.copytree(dcp_checkpoint, folder / f"pytorch_model_fsdp_{index}", ignore=shutil.ignore_patterns("huggingface"))
    (folder / "optimizer_0").mkdir()
    for name in os.listdir(f"{dcp_checkpoint}/huggingface"):
        shutil.copy(f"{dcp_checkpoint}/huggingface/{name}", folder / name)
    return folder


def test_an_accelerate_checkpoint_folder_is_read_from_its_model_folder(dcp_checkpoints, tmp_path, caplog):
    source = accelerate_checkpoint(dcp_checkpoints["tied"]["local"], tmp_path / "checkpoint-500")
    with caplog.at_level("INFO", logger="rayexport"):
        completed = run_main("--src", str(source), "--dst", str(tmp_path / "out"), "--dtype", "float32")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"reading the model checkpoint '{source}/pytorch_model_fsdp_0'" in caplog.text
    manifest = json.loads((tmp_path / "out" / "export_manifest.json").read_text())
    assert manifest["source"].endswith("checkpoint-500/pytorch_model_fsdp_0")
    torch.testing.assert_close(reload(str(tmp_path / "out"))["logits"], dcp_checkpoints["tied"]["logits"], rtol=1e-5, atol=1e-6)


def test_an_accelerate_checkpoint_folder_with_two_models_names_them(dcp_checkpoints, tmp_path):
    source = accelerate_checkpoint(dcp_checkpoints["tied"]["local"], tmp_path / "checkpoint-500", models=2)
    completed = run_main("--src", str(source), "--dst", str(tmp_path / "out"))
    assert completed.returncode == 1
    assert error_lines(completed) == [
        f"rayexport: error: '{source}' holds 2 model checkpoints (pytorch_model_fsdp_0, pytorch_model_fsdp_1); "
        "pass the one to export as --src"
    ]
