"""DCP checkpoints as five RL trainers save them, written by real FSDP2 gloo ranks: each trainer's
folders, the nesting of its saved state and the files it leaves beside it, reproduced from its
source (none of the trainers installs here). The source each follows is named in `PRODUCERS`.

Every rank shards the model (`rayexport.demo.fully_shard_model`), takes one Adam step with lr=0
(real moment tensors, weights unchanged) and saves each trainer's state with
`torch.distributed.checkpoint.save`. DCP replaces a `Stateful` value by its `state_dict()` before
it flattens the state, so the nested dicts here save exactly what the trainers' `Stateful`
wrappers (OpenRLHF's and prime-rl's `AppState`, AReaL's `DCPState`, NeMo-RL's `ModelState` and
`OptimizerState`, and ROLL's optimizer and scheduler objects) make DCP save.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass

import torch

from rayexport.demo import fully_shard_model, run_gloo_ranks, write_hf_folder
from support.models import PROMPT_IDS, build_model, reference_logits, tiny_config

STEP = 2
# The base model NeMo-RL's config.yaml names (`policy.model_name`).
NEMO_RL_MODEL_NAME = "rayexport-tests/tiny-llama-untied"


@dataclass(frozen=True)
class Producer:
    """Where a trainer puts its DCP model save under the run's output folder, and what it saves.

    `src` is the folder a user passes as --src (relative to the run's folder); `prefix` the key
    prefix of its model state; `training_state` the top-level stored names of what it saves
    beside the model in that DCP folder (optimizer, scheduler, ...), which an export skips."""

    source: str  # the trainer file this reproduces
    src: str
    prefix: str
    training_state: tuple[str, ...]
    model_kind: str = "qwen2-tied"


PRODUCERS = {
    # OpenRLHF PR #1176 (branch pr-1176-rebased-clean, 0c202eed): openrlhf/utils/fsdp2/checkpoint.py
    # _save_dcp_checkpoint, called by openrlhf/trainer/ray/ppo_actor.py save_checkpoint with
    # <ckpt_save_path>/dcp_ckpt/<tag>/dcp_checkpoint/_actor, tag "global_step_<N>".
    "openrlhf": Producer(
        "openrlhf/utils/fsdp2/checkpoint.py", f"dcp_ckpt/global_step_{STEP}/dcp_checkpoint/_actor",
        "app.model.", ("app.optimizers",),
    ),
    # prime-rl 559b4477: src/prime_rl/trainer/ckpt.py CheckpointManager.save_to_path and AppState,
    # at <output_dir>/checkpoints/step_<N>/trainer.
    "prime-rl": Producer(
        "src/prime_rl/trainer/ckpt.py", f"checkpoints/step_{STEP}/trainer",
        "app.model.", ("app.optimizers", "app.scheduler", "app.progress"),
    ),
    # AReaL 4aef98d8: areal/engine/fsdp_engine.py _save_to_dcp with DCPState from
    # areal/engine/fsdp_utils/checkpoint.py, at Saver.get_recover_checkpoint_path (areal/utils/saver.py):
    # <fileroot>/checkpoints/<user>/<experiment>/<trial>/<engine name>/recover_checkpoint.
    "areal": Producer(
        "areal/engine/fsdp_engine.py", "checkpoints/user/gsm8k-grpo/trial0/default/recover_checkpoint",
        "dcp.model.", ("dcp.optim",),
    ),
    # ROLL 8eb27cc2: roll/distributed/strategy/fsdp2_strategy.py save_checkpoint and
    # _save_checkpoint_with_dcp, save_dir <output_dir>/<worker>/checkpoint-<N> (roll/pipeline/base_worker.py)
    # as the uploader gathers it (roll/utils/upload_utils.py); the HF model is saved in save_dir itself.
    "roll": Producer(
        "roll/distributed/strategy/fsdp2_strategy.py", f"checkpoint-{STEP}/dcp",
        "", ("optimizer", "scheduler", "rng_state"), "llama-untied",
    ),
    # NeMo-RL 7ea279ab: nemo_rl/utils/native_checkpoint.py save_checkpoint (the DTensor policy
    # worker, dtensor_cfg._v2 false), paths from nemo_rl/algorithms/grpo.py and
    # nemo_rl/utils/checkpoint.py CheckpointManager.init_tmp_checkpoint (config.yaml, training_info.json).
    "nemo-rl": Producer(
        "nemo_rl/utils/native_checkpoint.py", f"results/grpo/step_{STEP}/policy/weights",
        "model.", (), "llama-untied",
    ),
    # The same with the Automodel policy worker (dtensor_cfg._v2 true, model_save_format torch_save):
    # nemo_rl/models/automodel/checkpoint.py save_checkpoint -> nemo_automodel's Checkpointer.save_model
    # (NVIDIA-NeMo/Automodel 36044ad3, components/checkpoint/checkpointing.py and stateful_wrappers.py):
    # flat keys in weights/model, a tied head left out; the optimizer in optimizer/optim.
    "nemo-rl-automodel": Producer(
        "nemo_rl/models/automodel/checkpoint.py", f"results/grpo/step_{STEP}/policy/weights/model",
        "", (),
    ),
}


@dataclass(frozen=True)
class ProducerCheckpoint:
    """A written trainer checkpoint and what a faithful export of it must reproduce."""

    producer: Producer
    run_dir: str  # the trainer's output folder
    src: str  # the DCP folder to pass as --src
    config_dir: str  # a Hugging Face folder of the model's config and tokenizer (for --hf-config)
    logits: torch.Tensor
    reference_state: dict[str, torch.Tensor]


def write_producer_checkpoints(root: str, names: list[str], world_size: int = 2) -> dict[str, ProducerCheckpoint]:
    """Write the checkpoints of the trainers `names` (keys of `PRODUCERS`) under `root/<name>/`,
    each of its own model (`tiny_config(producer.model_kind)`, seed by position), all saved by
    one set of `world_size` gloo ranks."""
    written, jobs = {}, []
    with tempfile.TemporaryDirectory(prefix="rayexport-producers-") as scratch:
        for seed, name in enumerate(names):
            producer = PRODUCERS[name]
            config = tiny_config(producer.model_kind)
            model = build_model(config, seed)
            run_dir = os.path.join(root, name)
            config_dir = os.path.join(root, f"{name}-hf")
            write_hf_folder(config, config_dir)
            weights = os.path.join(scratch, f"{name}.pt")
            torch.save(model.state_dict(), weights)
            jobs.append((name, config_dir, weights, run_dir))
            written[name] = ProducerCheckpoint(
                producer, run_dir, os.path.join(run_dir, producer.src), config_dir, reference_logits(model),
                {key: tensor.detach().clone() for key, tensor in model.state_dict().items()},
            )
            if name == "roll":
                # ROLL's rank 0 save_pretrained's the gathered model and the tokenizer into save_dir,
                # the DCP folder's parent: written here from the same weights, unsharded
                save_dir = os.path.dirname(written[name].src)
                model.save_pretrained(save_dir)
                write_hf_folder(config, save_dir)
        run_gloo_ranks(world_size, _save_rank, jobs)
    return written


def _save_rank(rank: int, world_size: int, jobs: list[tuple[str, str, str, str]]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for name, config_dir, weights, run_dir in jobs:
        model = build_model(AutoConfig.from_pretrained(config_dir))
        model.load_state_dict(torch.load(weights, weights_only=True))
        model = fully_shard_model(model, mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
        model(input_ids=torch.tensor(PROMPT_IDS)).logits.float().pow(2).mean().backward()
        optimizer.step()
        scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        src = os.path.join(run_dir, PRODUCERS[name].src)
        for folder, state in _SAVES[name](model, optimizer, scheduler).items():
            dcp.save(state, checkpoint_id=os.path.normpath(os.path.join(src, folder)))
        if rank == 0:
            _SIDE_FILES[name](run_dir, src, scheduler)


def _model_and_optimizer(model, optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, [optimizer])


def _openrlhf(model, optimizer, scheduler) -> dict[str, dict]:
    model_state, optim_state = _model_and_optimizer(model, optimizer)
    return {"": {"app": {"model": model_state, "optimizers": optim_state}}}


def _prime_rl(model, optimizer, scheduler) -> dict[str, dict]:
    model_state, optim_state = _model_and_optimizer(model, optimizer)
    progress = {"step": STEP, "total_tokens": 4096, "total_samples": 64}  # asdict(Progress)
    return {"": {"app": {
        "model": model_state, "optimizers": optim_state, "scheduler": scheduler.state_dict(), "progress": progress,
    }}}


def _areal(model, optimizer, scheduler) -> dict[str, dict]:
    model_state, optim_state = _model_and_optimizer(model, optimizer)
    return {"": {"dcp": {"model": model_state, "optim": optim_state}}}


def _roll(model, optimizer, scheduler) -> dict[str, dict]:
    import numpy

    # get_rng_state(): "device" is the accelerator's generator state, a byte tensor like the CPU's
    rng_state = {
        "cpu": torch.get_rng_state(), "device": torch.get_rng_state(),
        "numpy": numpy.random.get_state(), "random": random.getstate(),
    }
    return {"": {
        **model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "rng_state": rng_state,
    }}


def _nemo_rl(model, optimizer, scheduler) -> dict[str, dict]:
    """policy/weights holds the model; policy/optimizer (beside it, a DCP checkpoint of its own)
    the optimizer and scheduler."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(cpu_offload=True)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    return {
        "": {"model": get_model_state_dict(model, options=options)},
        "../optimizer": {"optim": {"optim": optim_state, "sched": scheduler.state_dict()}},
    }


def _nemo_rl_automodel(model, optimizer, scheduler) -> dict[str, dict]:
    """weights/model holds the flat model state dict, without the head where it is the
    embedding (ModelState._get_base_model_state_dict); optimizer/optim the optimizer's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model)
    if model.lm_head.weight is model.get_input_embeddings().weight:
        model_state.pop("lm_head.weight")
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    return {
        "": model_state,
        "../../optimizer/optim": {"optim": optim_state, "sched": scheduler.state_dict()},
    }


# Each trainer's DCP saves: {folder, relative to its --src: the state it hands dcp.save}.
_SAVES = {
    "openrlhf": _openrlhf, "prime-rl": _prime_rl, "areal": _areal, "roll": _roll,
    "nemo-rl": _nemo_rl, "nemo-rl-automodel": _nemo_rl_automodel,
}


def _openrlhf_files(run_dir: str, src: str, scheduler) -> None:
    """extra_state.pt and STABLE in the DCP folder, `latest` naming the step's tag."""
    extra = {
        "client_state": {"global_step": STEP, "episode": 0}, "scheduler": scheduler.state_dict(), "runtime_state": {},
    }
    torch.save(extra, os.path.join(src, "extra_state.pt"))
    _write(os.path.join(src, "STABLE"), "ok\n")
    _write(os.path.join(run_dir, "dcp_ckpt", "latest"), f"global_step_{STEP}")


def _nemo_rl_files(run_dir: str, src: str, scheduler) -> None:
    """The step folder's config.yaml (part of the run's config, yaml.safe_dump'd as NeMo-RL does),
    training_info.json and train_dataloader.pt, and the tokenizer in policy/tokenizer."""
    import yaml

    step_dir = os.path.join(run_dir, "results", "grpo", f"step_{STEP}")
    config = {
        "policy": {"model_name": NEMO_RL_MODEL_NAME, "tokenizer": {"name": NEMO_RL_MODEL_NAME},
                   "dtensor_cfg": {"_v2": src.endswith("/model"), "enabled": True}},
        "checkpointing": {"enabled": True, "checkpoint_dir": "results/grpo", "save_optimizer": True},
    }
    _write(os.path.join(step_dir, "config.yaml"), yaml.safe_dump(config))
    _write(os.path.join(step_dir, "training_info.json"), json.dumps({"step": STEP, "total_steps": STEP}))
    torch.save({}, os.path.join(step_dir, "train_dataloader.pt"))
    write_hf_folder(tiny_config("llama-untied"), os.path.join(step_dir, "policy", "tokenizer"))
    os.remove(os.path.join(step_dir, "policy", "tokenizer", "config.json"))  # only the tokenizer's files
    os.remove(os.path.join(step_dir, "policy", "tokenizer", "generation_config.json"))


def _no_files(run_dir: str, src: str, scheduler) -> None:
    pass


_SIDE_FILES = {
    "openrlhf": _openrlhf_files, "prime-rl": _no_files, "areal": _no_files, "roll": _no_files,
    "nemo-rl": _nemo_rl_files, "nemo-rl-automodel": _nemo_rl_files,
}


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)
