"""The model a checkpoint belongs to, from its Hugging Face folder: config, class, and the
names, shapes and ties of its tensors, learnt on the meta device (no weights, no hub)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rayexport.common.dtypes import dtype_name, is_floating
from rayexport.common.errors import ExportError, one_line
from rayexport.model.remote_code import auto_map_files, bundle_model_code
from rayexport.model.saved import Described, RecentDescriptions, with_saved
from rayexport.plan.formats import ModelFormats
from rayexport.plan.lora import ADAPTER_CONFIG, adapter_config, fan_in_fan_out_weights
from rayexport.plan.naming import TensorPlanning
from rayexport.plan.ties import find_tie_aliases
from rayexport.storage.store import Store

if TYPE_CHECKING:
    import torch

WEIGHT_FILE = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.safetensors\.index\.json|\.bin\.index\.json)$")


def hf_file_names(hf_store: Store, trainers: frozenset[str] = frozenset()) -> list[str]:
    """The files of a Hugging Face folder worth carrying into an export: everything but weights
    and the trainer's own files and folders there (`trainers`, names at the folder's top)."""
    return [
        name for name in hf_store.find() if not WEIGHT_FILE.search(name) and name.split("/", 1)[0] not in trainers
    ]


def fetch_hf_folder(hf_store: Store, local_dir: str, trainers: frozenset[str] = frozenset()) -> list[str]:
    """Copy the non-weight files of a Hugging Face folder (less `trainers`' files) to `local_dir`;
    return their names."""
    names = hf_file_names(hf_store, trainers)
    for name in names:
        target = os.path.join(local_dir, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(hf_store.read_bytes(name))
    return names


def load_config(local_dir: str, raw: dict, trust_remote_code: bool):
    """The model's `PretrainedConfig` from a local HF folder whose config.json parsed to `raw`,
    with one clear line for any problem."""
    from transformers import AutoConfig

    if raw.get("auto_map") and not trust_remote_code:
        raise ExportError(
            "config.json has auto_map (remote code); pass --trust-remote-code to build it"
        )
    try:
        return AutoConfig.from_pretrained(local_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - transformers raises many types
        raise ExportError(f"config.json cannot be loaded by transformers: {one_line(error)}") from None


def config_dtype(config) -> str | None:
    """The dtype the config declares (`dtype`, formerly `torch_dtype`), as a torch name."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return None
    return dtype_name(value) if not isinstance(value, str) else value.removeprefix("torch.")


@dataclass(frozen=True)
class ModelClass:
    """How to build this config's model: an architecture class, or an Auto class for remote code."""

    class_name: str
    auto_class: bool

    def resolve(self):
        import transformers

        return getattr(transformers, self.class_name)

    def build(self, config, trust_remote_code: bool) -> torch.nn.Module:
        cls = self.resolve()
        if self.auto_class:
            return cls.from_config(config, trust_remote_code=trust_remote_code)
        return cls._from_config(config)

    def load(self, path: str, trust_remote_code: bool, **kwargs: Any) -> torch.nn.Module:
        kwargs = dict(kwargs, trust_remote_code=trust_remote_code) if self.auto_class else kwargs
        return self.resolve().from_pretrained(path, **kwargs)


def model_class(config) -> ModelClass:
    """The class named by `architectures`, or for remote code the Auto class that maps to it."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_name, reference in auto_map.items():
        if (
            auto_name.startswith("AutoModel")
            and isinstance(reference, str)
            and reference.rsplit(".", 1)[-1] == architecture
        ):
            return ModelClass(auto_name, auto_class=True)
    if architecture and hasattr(transformers, architecture):
        return ModelClass(architecture, auto_class=False)
    if architecture is None:
        raise ExportError("config.json names no architectures; cannot tell which model to build")
    raise ExportError(f"architecture '{architecture}' in config.json is not a transformers class")


def build_meta_model(config, trust_remote_code: bool) -> torch.nn.Module:
    """The model on the meta device: every name, shape and tie, and no memory."""
    import torch

    try:
        with torch.device("meta"):
            return model_class(config).build(config, trust_remote_code)
    except ExportError:
        raise
    except Exception as error:  # noqa: BLE001 - model code raises anything
        raise ExportError(f"cannot build the model from config.json: {type(error).__name__}: {one_line(error)}") from None


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every state-dict name of the model (tied aliases included) with its shape and dtype."""
    return {
        name: (tuple(tensor.shape), dtype_name(tensor.dtype))
        for name, tensor in model.state_dict(keep_vars=True).items()
    }


def kept_in_float32(model: torch.nn.Module, names: set[str]) -> dict[str, frozenset[str]]:
    """Those of `names` (the model's, in memory and on disk) that transformers loads in float32
    whatever the checkpoint's dtype, by
    the dtype the rest is loaded in: the class's `_keep_in_fp32_modules_strict` in bfloat16 and
    float16, and its `_keep_in_fp32_modules` in float16 too (patterns matched as transformers
    matches them: searched for, `*` any run of characters)."""
    strict = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    loose = set(getattr(model, "_keep_in_fp32_modules", None) or ())

    def matching(patterns: set[str]) -> frozenset[str]:
        if not patterns:
            return frozenset()
        found = re.compile("|".join(f"(?:{pattern.replace('*', '.*')})" for pattern in sorted(patterns)))
        return frozenset(name for name in names if found.search(name))

    kept = {"bfloat16": matching(strict), "float16": matching(strict | loose)}
    return {dtype: names for dtype, names in kept.items() if names}


def saved_config(config, raw_config: dict) -> dict:
    """config.json as `save_pretrained` writes it (transformers' own serialisation of the
    config: nested sub-configs, its version), keeping the checkpoint's `auto_map`."""
    saved = config.to_diff_dict()
    if "auto_map" in raw_config:
        saved["auto_map"] = raw_config["auto_map"]
    return saved


def exported_config(config: dict, dtype: str | None, untie: bool = False) -> dict:
    """config.json for the export: the dtype the weights were written in, untied embeddings
    (wherever the config declares the tie: top level or `text_config`), and no None entries in
    `auto_map` (transformers rejects them)."""
    config = dict(config)
    if dtype is not None:
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
        for key, value in config.items():  # sub-configs: save_pretrained states the dtype once, at the top
            if isinstance(value, dict) and "model_type" in value:
                config[key] = {name: item for name, item in value.items() if name not in ("dtype", "torch_dtype")}
    if untie:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = dict(config["text_config"], tie_word_embeddings=False)
    if isinstance(config.get("auto_map"), dict):
        config["auto_map"] = {key: value for key, value in config["auto_map"].items() if value is not None}
    return config


@dataclass(frozen=True)
class ModelDescription:
    """The model a checkpoint belongs to, as its HF folder describes it."""

    carried: dict[str, bytes]  # files the export carries as they are (tokenizer, code, ...)
    config: dict  # config.json as save_pretrained writes it
    config_dtype: str | None  # the dtype the config declares
    formats: ModelFormats  # names, shapes and ties, in memory and on disk
    fan_in_fan_out: frozenset[str]  # weights stored transposed (Conv1D), for LoRA merges
    # by the dtype weights are written in, the tensors the model's class loads in float32 anyway
    float32_names: dict[str, frozenset[str]] = field(default_factory=dict)


# Those of this process (a watcher's exports, `export_remote`'s in a reused Ray worker).
_DESCRIBED = RecentDescriptions()


def describe_model(
    hf_store: Store, base_model: Store | None, trust_remote_code: bool, trainers: frozenset[str] = frozenset(),
    described: Described | None = None,
) -> ModelDescription:
    """Config, meta-model names/shapes and tie aliases, and every file the export carries
    (tokenizer, generation config, remote code), from the checkpoint's HF folder, less its
    trainer's own files there (`trainers`). Remote code
    the folder lacks comes from the base model folder, else from the model's class module.
    A folder whose files are byte for byte those of one described before is described again
    from `described` (default: this process's descriptions), else from those saved by earlier
    processes (`rayexport.model.saved`)."""
    described = with_saved(_DESCRIBED if described is None else described)
    with tempfile.TemporaryDirectory(prefix="rayexport-hf-") as local:
        names = fetch_hf_folder(hf_store, local, trainers)
        with open(os.path.join(local, "config.json"), "rb") as handle:
            raw_config = _parse_json(handle.read(), hf_store.display("config.json"))
        code_files = auto_map_files(raw_config)
        if base_model is not None:
            wanted = [name for name in code_files if name not in names]
            available = set(hf_file_names(base_model)) if wanted else set()
            for name in wanted:
                if name in available:
                    with open(os.path.join(local, name), "wb") as handle:
                        handle.write(base_model.read_bytes(name))
        key = _folder_key(local, trust_remote_code)
        if (known := described.get(key)) is not None:
            return known
        config = load_config(local, raw_config, trust_remote_code)
        meta_model = build_meta_model(config, trust_remote_code)
        if any(not os.path.exists(os.path.join(local, name)) for name in code_files):
            bundle_model_code(meta_model, local)
        for name in code_files:
            if not os.path.exists(os.path.join(local, name)):
                raise ExportError(f"config.json's auto_map needs {name}, which is neither in '{hf_store.uri}' nor bundled")
        carried = _folder_files(local)
    from rayexport.model.conversion import model_formats  # torch's dispatch machinery, for a model built here

    formats = model_formats(meta_model, expected_tensors(meta_model), find_tie_aliases(meta_model))
    description = ModelDescription(
        carried=carried,
        config=saved_config(config, raw_config),
        config_dtype=config_dtype(config),
        formats=formats,
        fan_in_fan_out=fan_in_fan_out_weights(meta_model),
        float32_names=kept_in_float32(meta_model, set(formats.memory.expected) | set(formats.disk.expected)),
    )
    described[key] = description
    return description


def _folder_files(local: str) -> dict[str, bytes]:
    """Every file under the folder `local`, by its path relative to it."""
    files = {}
    for folder, _, names in os.walk(local):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, local)] = handle.read()
    return files


def _folder_key(local: str, trust_remote_code: bool) -> str:
    """What a description is derived from: every file's path and bytes, whether remote code runs,
    and the transformers that builds the model (a pool's descriptions serve other processes)."""
    from importlib.metadata import version

    digest = hashlib.sha256((b"remote code" if trust_remote_code else b"") + version("transformers").encode())
    for name, data in sorted(_folder_files(local).items()):
        digest.update(hashlib.sha256(name.encode()).digest() + hashlib.sha256(data).digest())
    return digest.hexdigest()


def _parse_json(data: bytes, uri: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError as error:
        raise ExportError(f"'{uri}' is not valid JSON: {one_line(error)}") from None
    if not isinstance(value, dict):
        raise ExportError(f"'{uri}' is not a JSON object")
    return value


def hf_folder(checkpoint_folder: Store | None, hf_config: Store | None, nearby: Store | None, base_model: Store | None) -> Store:
    """Where config, tokenizer and code come from: the checkpoint's own folder for them (e.g.
    verl's `huggingface/`) when it has a config.json, else `--hf-config`, else the folder
    beside the checkpoint (a Trainer's), else the `--base-model` folder. Without any, the error
    names where it looked, and the base model where the trainer's own config names it."""
    if checkpoint_folder is not None and checkpoint_folder.exists("config.json"):
        return checkpoint_folder
    for folder in (hf_config, nearby, base_model):
        if folder is not None:
            if not folder.exists("config.json"):
                raise ExportError(f"missing '{folder.display('config.json')}'")
            return folder
    if checkpoint_folder is None:
        where, named = "config.json", ""
    else:
        where, named = f"'{checkpoint_folder.display('config.json')}'", _named_base_model(checkpoint_folder)
    model = "that model's" if named else "the model's"
    raise ExportError(
        f"missing {where}{named}: pass --hf-config URI (a folder with {model} config.json and tokenizer) "
        "or --base-model"
    )


# NeMo-RL's checkpoint folders: step_N/config.yaml (the run's config) above step_N/policy/weights/
# (DTensor worker) or step_N/policy/weights/model/ (Automodel worker), whose `huggingface/` is looked in.
NEMO_RL_CONFIG = "config.yaml"
NEMO_RL_LEVELS = 4


def _named_base_model(folder: Store) -> str:
    """Where a trainer's own config file above `folder` names the model it trained (NeMo-RL's
    `config.yaml`, `policy.model_name`), a clause saying so for the missing-config error; else ""."""
    import yaml

    above = folder
    for _ in range(NEMO_RL_LEVELS):
        above = above.parent()
        if above is None:
            break
        try:
            if not above.exists(NEMO_RL_CONFIG):
                continue
            config = yaml.safe_load(above.read_bytes(NEMO_RL_CONFIG))
        except (ExportError, yaml.YAMLError):
            return ""  # the missing config is the error; an unreadable file only loses the hint
        policy = config.get("policy") if isinstance(config, dict) else None
        name = policy.get("model_name") if isinstance(policy, dict) else None
        if isinstance(name, str) and name.strip() and name == one_line(name):
            return f"; NeMo-RL's '{above.display(NEMO_RL_CONFIG)}' names the base model '{name}'"
    return ""


def generated_files(config: dict, planning: TensorPlanning, untie: bool, base_model: str | None) -> dict[str, bytes]:
    """Files the export writes from what it learnt: config.json (and adapter_config.json)."""
    floating = sorted({
        plan.dtype for plan in planning.tensors
        if is_floating(plan.dtype) and plan.name not in planning.kept_float32
    })
    config = exported_config(config, floating[0] if len(floating) == 1 else None, untie)
    files = {"config.json": _json_bytes(config)}
    if planning.adapters:
        files[ADAPTER_CONFIG] = _json_bytes(
            adapter_config(planning.lora, planning.lora_targets, base_model)
        )
    return files


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, default=_jsonable) + "\n").encode()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
