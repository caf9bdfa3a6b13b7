"""The DCP checkpoints RL trainers save: OpenRLHF's FSDP2 backend, prime-rl, AReaL, ROLL and
NeMo-RL, each written by 2 real FSDP2 gloo ranks in the trainer's own folders and nesting
(`support.producer_checkpoints`, reproduced from the trainer's source: none of them installs
here). Each is found with exactly the model's keys and its training state skipped; OpenRLHF's
and NeMo-RL's export through the CLI, S3 to S3, to the original model; and where the trainer
saved no config, the CLI's one error line says where it looked and what the trainer names."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from rayexport.layouts.base import SourceSettings
from rayexport.layouts.registry import find_checkpoint
from rayexport.storage.store import Store
from support.helpers import BUCKET, download, error_lines, exported_tensors, reload, run_main, upload
from support.producer_checkpoints import NEMO_RL_MODEL_NAME, PRODUCERS, write_producer_checkpoints


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every producer's checkpoint, all saved by one set of 2 gloo ranks."""
    return write_producer_checkpoints(str(tmp_path_factory.mktemp("producers")), list(PRODUCERS), world_size=2)


def assert_described(written, name: str, expected_keys: set[str] | None = None) -> None:
    """The checkpoint at the producer's --src is found as DCP with the model's keys under its
    prefix, and every other stored entry (its training state) is skipped."""
    checkpoint, producer = written[name], written[name].producer
    described = find_checkpoint(Store(checkpoint.src), "auto", SourceSettings())
    assert described.layout == "dcp" and described.world_size == 2
    assert described.prefix == producer.prefix
    assert set(described.tensors) == (expected_keys if expected_keys is not None else set(checkpoint.reference_state))
    for key, tensor in described.tensors.items():
        assert tensor.key == producer.prefix + key
        assert tensor.shape == tuple(checkpoint.reference_state[key].shape), key
    stored = FileSystemReader(checkpoint.src).read_metadata().state_dict_metadata
    assert sorted(described.skipped) == sorted(set(stored) - {tensor.key for tensor in described.tensors.values()})
    roots = {root for root in producer.training_state for key in described.skipped if key.startswith(root + ".")}
    assert roots == set(producer.training_state)  # each part of the training state is there, and skipped
    assert all(key.startswith(tuple(root + "." for root in producer.training_state)) for key in described.skipped)


def test_openrlhf_fsdp2_actor_save(written):
    """Reproduces OpenRLHF's FSDP2 actor save from its source (openrlhf/utils/fsdp2/checkpoint.py
    `_save_dcp_checkpoint`, PR #1176), since OpenRLHF does not install here:
    `dcp_ckpt/global_step_N/dcp_checkpoint/_actor/` holding {"app": {"model", "optimizers"}},
    with `extra_state.pt` and `STABLE` beside."""
    assert_described(written, "openrlhf")
    src = written["openrlhf"].src
    assert {"extra_state.pt", "STABLE"} <= set(os.listdir(src))


def test_prime_rl_trainer_save(written):
    """Reproduces prime-rl's trainer checkpoint from its source (src/prime_rl/trainer/ckpt.py
    `CheckpointManager.save_to_path`), since prime-rl does not install here:
    `checkpoints/step_N/trainer/` holding {"app": {"model", "optimizers", "scheduler", "progress"}}."""
    assert_described(written, "prime-rl")


def test_areal_recover_checkpoint(written):
    """Reproduces AReaL's recover checkpoint from its source (areal/engine/fsdp_engine.py
    `_save_to_dcp`, areal/engine/fsdp_utils/checkpoint.py `DCPState`), since AReaL does not install
    here: `<experiment>/<trial>/default/recover_checkpoint/` holding {"dcp": {"model", "optim"}}."""
    assert_described(written, "areal")


def test_roll_fsdp2_save(written):
    """Reproduces ROLL's FSDP2 checkpoint from its source (roll/distributed/strategy/fsdp2_strategy.py
    `_save_checkpoint_with_dcp`), since ROLL does not install here: `checkpoint-N/dcp/` holding
    the model's flat keys beside "optimizer", "scheduler" and "rng_state", the HF model in
    `checkpoint-N/` itself, where its config and tokenizer are taken from without --hf-config."""
    assert_described(written, "roll")
    described = find_checkpoint(Store(written["roll"].src), "auto", SourceSettings())
    assert described.nearby_hf_folder.uri == os.path.dirname(written["roll"].src)


def test_nemo_rl_dtensor_policy_save(written):
    """Reproduces NeMo-RL's DTensor policy save from its source (nemo_rl/utils/native_checkpoint.py
    `save_checkpoint`), since NeMo-RL does not install here: `step_N/policy/weights/` holding
    {"model": ...}, the optimizer in `policy/optimizer/` (not read), `config.yaml` in `step_N/`."""
    assert_described(written, "nemo-rl")


def test_nemo_rl_automodel_policy_save(written):
    """Reproduces NeMo-RL's Automodel policy save from its source (nemo_rl/models/automodel/checkpoint.py,
    saving through nemo_automodel's `Checkpointer.save_model`), since neither installs here:
    `step_N/policy/weights/model/` holding the flat model keys, a tied head left out."""
    reference = written["nemo-rl-automodel"].reference_state
    assert_described(written, "nemo-rl-automodel", set(reference) - {"lm_head.weight"})


@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_without_planner_data_the_keys_alone_find_the_model(written, name, tmp_path):
    """A `.metadata` saved without the default planner's record of each key's nesting."""
    src = written[name].src
    metadata = FileSystemReader(src).read_metadata()
    assert metadata.planner_data
    for file in os.listdir(src):
        if file.endswith(".distcp"):
            shutil.copy(os.path.join(src, file), tmp_path)
    with open(tmp_path / ".metadata", "wb") as handle:
        pickle.dump(dataclasses.replace(metadata, planner_data=None), handle)
    keys_alone = find_checkpoint(Store(str(tmp_path)), "auto", SourceSettings())
    described = find_checkpoint(Store(src), "auto", SourceSettings())
    assert (keys_alone.prefix, keys_alone.tensors.keys(), keys_alone.skipped) == (
        described.prefix, described.tensors.keys(), described.skipped,
    )


# --- through the CLI ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_s3(written, s3_endpoint):
    """OpenRLHF's and NeMo-RL's runs, and a Hugging Face folder of each one's model, on S3."""
    root = f"s3://{BUCKET}/producers"
    uploaded = {}
    for name in ("openrlhf", "nemo-rl"):
        checkpoint = written[name]
        run = upload(checkpoint.run_dir, f"{root}/{name}")
        uploaded[name] = {
            "src": run + checkpoint.src.removeprefix(checkpoint.run_dir),
            "hf": upload(checkpoint.config_dir, f"{root}/{name}-hf"),
        }
    return uploaded

@pytest.mark.parametrize("name", ["openrlhf", "nemo-rl"])
def test_export_through_the_cli_matches_the_original(written, on_s3, warm_pool, s3_prefix, tmp_path, name):
    """`--src` the trainer's DCP folder, `--hf-config` the model's folder (neither trainer saves
    a config): the export holds the original model's tensors, and reloaded gives its logits."""
    checkpoint = written[name]
    report_path = tmp_path / "report.json"
    completed = run_main(
        "--src", on_s3[name]["src"], "--dst", s3_prefix, "--hf-config", on_s3[name]["hf"],
        "--workers", "2", "--dtype", "float32", "--report", str(report_path), "--pool", warm_pool,
        "--verify", "quick",  # files and a sample: this test reloads the export itself, below
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    stored = FileSystemReader(checkpoint.src).read_metadata().state_dict_metadata
    model_keys = {checkpoint.producer.prefix + key for key in checkpoint.reference_state}
    assert report["layout"] == "dcp" and sorted(report["skipped"]) == sorted(set(stored) - model_keys)
    local = download(s3_prefix, str(tmp_path / "export"))
    exported = exported_tensors(local)
    tied = json.loads((tmp_path / "export" / "config.json").read_text()).get("tie_word_embeddings", False)
    assert set(exported) == set(checkpoint.reference_state) - ({"lm_head.weight"} if tied else set())
    for key, tensor in exported.items():
        assert torch.equal(tensor, checkpoint.reference_state[key]), key
    torch.testing.assert_close(reload(local)["logits"], checkpoint.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["openrlhf", "nemo-rl"])
def test_without_a_config_the_error_says_where_it_looked(on_s3, ray_address, s3_prefix, name):
    """Neither trainer saves a config.json with its DCP checkpoint; NeMo-RL's step folder has
    the run's config.yaml, whose policy.model_name is the model to pass as --hf-config."""
    src = on_s3[name]["src"]
    completed = run_main("--src", src, "--dst", s3_prefix)
    assert completed.returncode == 1
    step = src.removesuffix("/policy/weights")
    after = {
        "openrlhf": ": pass --hf-config URI (a folder with the model's config.json and tokenizer) or --base-model",
        "nemo-rl": f"; NeMo-RL's '{step}/config.yaml' names the base model '{NEMO_RL_MODEL_NAME}': "
                   "pass --hf-config URI (a folder with that model's config.json and tokenizer) or --base-model",
    }
    assert error_lines(completed) == [f"rayexport: error: missing '{src}/huggingface/config.json'{after[name]}"]
