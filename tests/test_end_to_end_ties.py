"""Every tied-weight case through the CLI against S3 (BRIEF 1.1 and 1.3): the files written,
the config, and the reload."""

from __future__ import annotations

import glob
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from support.helpers import download, reload, run_main, s3_exists, upload

pytestmark = pytest.mark.usefixtures("ray_address")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def edit_rank_files(folder, edit) -> None:
    """Rewrite every rank file of a checkpoint with `edit(state)` applied."""
    import torch.distributed.tensor  # noqa: F401 - DTensors in the files

    for path in sorted(glob.glob(f"{folder}/model_world_size_*_rank_*.pt")):
        state = torch.load(path, weights_only=True)
        edit(state)
        torch.save(state, path)


def modified_checkpoint(checkpoints, tmp_path, s3_prefix, edit) -> str:
    folder = shutil.copytree(checkpoints["tied"].path, tmp_path / "ckpt")
    edit_rank_files(folder, edit)
    return upload(str(folder), f"{s3_prefix}-src")


def exported_keys(local: str) -> set[str]:
    with safe_open(f"{local}/model.safetensors", framework="pt") as handle:
        return set(handle.keys())


def untie_head(state) -> None:
    # The head's local shard is a view of the embedding's storage in a tied save: give it its own,
    # as if training had untied them (the private attribute is the only way without a process group).
    head = state[HEAD]
    head._local_tensor = head._local_tensor.clone() + 0.25


def test_divergent_tied_values_stop_the_export(checkpoints, tmp_path, s3_prefix):
    source = modified_checkpoint(checkpoints, tmp_path, s3_prefix, untie_head)
    completed = run_main("--src", source, "--dst", s3_prefix, "--workers", "2")
    assert completed.returncode == 1
    assert f"tied tensors '{EMBED}' and '{HEAD}' differ" in completed.stderr
    assert "max abs difference 0.25" in completed.stderr
    assert not s3_exists(f"{s3_prefix}/export_manifest.json")


def test_untie_keeps_both_and_unties_the_config(checkpoints, tmp_path, s3_prefix, warm_pool):
    source = modified_checkpoint(checkpoints, tmp_path, s3_prefix, untie_head)
    completed = run_main("--src", source, "--dst", s3_prefix, "--workers", "2", "--untie", "--verify", "none", "--dtype", "float32",
                         "--pool", warm_pool)
    assert completed.returncode == 0, completed.stderr[-3000:]
    local = download(s3_prefix, str(tmp_path / "export"))
    assert {EMBED, HEAD} <= exported_keys(local)
    assert json.load(open(f"{local}/config.json"))["tie_word_embeddings"] is False
    reloaded = reload(local)
    assert reloaded["shared"] is False
    # the trained (untied) model: the original with its head moved by 0.25
    from support.models import PROMPT_IDS, build_model, tiny_config

    model = build_model(tiny_config("qwen2-tied", tie_word_embeddings=False))
    state = dict(checkpoints["tied"].reference_state, **{HEAD: checkpoints["tied"].reference_state[EMBED] + 0.25})
    model.load_state_dict(state)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(PROMPT_IDS)).logits
    torch.testing.assert_close(reloaded["logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dropped, kept", [(EMBED, HEAD), (HEAD, EMBED)], ids=["only-alias", "only-canonical"])
def test_one_tied_key_is_enough(checkpoints, tmp_path, s3_prefix, dropped, kept, warm_pool):
    """Only the head saved: it is promoted to the embedding's name. Only the embedding saved: no
    KeyError for the head. Either way one copy is written and the reload ties it."""
    source = modified_checkpoint(checkpoints, tmp_path, s3_prefix, lambda state: state.pop(dropped))
    completed = run_main("--src", source, "--dst", s3_prefix, "--workers", "2", "--verify", "none", "--dtype", "float32",
                         "--pool", warm_pool)
    assert completed.returncode == 0, completed.stderr[-3000:]
    local = download(s3_prefix, str(tmp_path / "export"))
    keys = exported_keys(local)
    assert EMBED in keys and HEAD not in keys
    reloaded = reload(local)
    assert reloaded["shared"] is True
    torch.testing.assert_close(reloaded["logits"], checkpoints["tied"].logits, rtol=1e-5, atol=1e-6)
