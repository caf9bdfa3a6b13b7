"""torch's sharded HF safetensors (2 FSDP2 gloo ranks, 2 files each) through the CLI with 2
workers, as torchtitan's `last_save_in_hf` leaves them (`step-N/sharded/`, config from
`--hf-config`) and as NeMo Automodel saves them (`model/`, config in `model/.hf_metadata/`, on S3)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

from support.helpers import download, error_lines, exported_tensors, reload, run_main, upload

pytestmark = pytest.mark.usefixtures("ray_address")


@pytest.fixture(scope="module")
def saved(hf_sharded_checkpoints):
    return hf_sharded_checkpoints

def test_a_torchtitan_sharded_folder_exports_what_torch_consolidates(saved, tmp_path):
    checkpoint = saved["titan"]
    refused = run_main("--src", checkpoint.path, "--dst", str(tmp_path / "refused"))
    assert refused.returncode == 1 and error_lines(refused) == [
        f"rayexport: error: missing '{checkpoint.path.removesuffix('/sharded')}/huggingface/config.json': "
        "pass --hf-config URI (a folder with the model's config.json and tokenizer) or --base-model"
    ]
    report_path = tmp_path / "report.json"
    completed = run_main("--src", checkpoint.path, "--dst", str(tmp_path / "out"), "--hf-config", saved["titan-hf"],
                         "--workers", "2", "--dtype", "float32", "--report", str(report_path))
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["layout"] == "hf-sharded" and report["world_size"] == 2 and report["workers"] == 2

    (tmp_path / "merged").mkdir()
    consolidate_safetensors_files(checkpoint.path, str(tmp_path / "merged"), dict.fromkeys(checkpoint.reference_state, 1))
    merged, exported = exported_tensors(tmp_path / "merged"), exported_tensors(tmp_path / "out")
    assert set(merged) - set(exported) == {"lm_head.weight"}  # tied: written once, as the embedding
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, merged[key], rtol=0, atol=0)
    reloaded = reload(str(tmp_path / "out"))
    torch.testing.assert_close(reloaded["logits"], checkpoint.logits, rtol=1e-5, atol=1e-6)
    assert reloaded["shared"]


def test_an_automodel_save_on_s3_takes_its_config_from_beside_the_shards(saved, s3_prefix, tmp_path):
    checkpoint = saved["automodel"]
    src = upload(checkpoint.path, f"{s3_prefix}-src/epoch_0_step_10/model")
    completed = run_main("--src", src, "--dst", s3_prefix, "--workers", "2", "--dtype", "float32")
    assert completed.returncode == 0, completed.stderr[-3000:]
    local = download(s3_prefix, str(tmp_path / "export"))
    torch.testing.assert_close(reload(local)["logits"], checkpoint.logits, rtol=1e-5, atol=1e-6)
