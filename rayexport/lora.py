"""LoRA / PEFT: recognising adapter keys, their settings, and folding them into base weights.

Pure functions; the merge runs on the exporter once a layer's base weight, A and B are gathered.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from rayexport.errors import ExportError

PEFT_PREFIX = "base_model.model."
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")
BASE_LAYER = ".base_layer."
# Name components of PEFT variants whose merge is not W + scale * B @ A: refused, never guessed.
UNMERGEABLE = {
    "lora_magnitude_vector": "DoRA",
    "modules_to_save": "modules_to_save copies",
    "original_module": "modules_to_save copies",
    "lora_embedding_A": "LoRA on embeddings",
    "lora_embedding_B": "LoRA on embeddings",
    "lora_E": "AdaLoRA",
    "hada_w1": "LoHa",
    "lokr_w1": "LoKr",
    "ia3_l": "IA3",
}
LORA_BIAS = re.compile(r"\.lora_B\.[^.]+\.bias$")
ADAPTER_DIR = "lora_adapter"
# peft's SAFETENSORS_WEIGHTS_NAME and CONFIG_NAME inside ADAPTER_DIR (peft is imported only
# where it runs: importing it pulls in transformers)
ADAPTER_WEIGHTS = f"{ADAPTER_DIR}/adapter_model.safetensors"
ADAPTER_CONFIG = f"{ADAPTER_DIR}/adapter_config.json"


@dataclass(frozen=True)
class LoraTarget:
    """One adapted module: its model name and the (normalised) names of its A and B."""

    module: str
    a_name: str
    b_name: str


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: int | float
    use_rslora: bool
    task_type: str | None

    @property
    def scale(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def is_peft_checkpoint(names: Iterable[str]) -> bool:
    return any(name.startswith(PEFT_PREFIX) for name in names)


def split_peft_names(names: Iterable[str]) -> tuple[dict[str, str], list[LoraTarget]]:
    """Model name -> checkpoint name for base tensors (`base_model.model.` and `base_layer.`
    removed), and the LoRA targets. Raises on any PEFT variant that cannot be merged exactly."""
    base: dict[str, str] = {}
    halves: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        variant = unmergeable_variant(name)
        if variant:
            raise ExportError(f"tensor '{name}' belongs to a PEFT variant rayexport cannot merge exactly: {variant}")
        stripped = name.removeprefix(PEFT_PREFIX)
        match = LORA_KEY.match(stripped)
        if match:
            halves.setdefault((match["module"], match["adapter"]), {})[match["which"]] = name
            continue
        base[stripped.replace(BASE_LAYER, ".")] = name
    adapters = {adapter for _, adapter in halves}
    if len(adapters) > 1:
        raise ExportError(f"the checkpoint holds several LoRA adapters ({', '.join(sorted(adapters))}); export one at a time")
    targets = []
    for (module, _), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ExportError(f"LoRA module '{module}' has lora_{next(iter(pair))} but not its other half")
        targets.append(LoraTarget(module, pair["A"], pair["B"]))
    return base, targets


def unmergeable_variant(name: str) -> str | None:
    """The PEFT variant a tensor name belongs to, when its merge is not plain LoRA."""
    if LORA_BIAS.search(name):
        return "LoRA bias"
    for part in name.split("."):
        for marker, variant in UNMERGEABLE.items():
            if part.startswith(marker):
                return variant
    return None


def lora_settings(meta: dict[str, Any] | None, rank_of_a: int, overrides: dict[str, Any]) -> LoraSettings:
    """r, alpha, rsLoRA and task type from `lora_train_meta.json`, overridden by the user's
    options; r defaults to lora_A's first dimension. alpha is never guessed and never 0."""
    values = {**(meta or {}), **{key: value for key, value in overrides.items() if value is not None}}
    r = int(values.get("r") or rank_of_a)
    if r != rank_of_a:
        raise ExportError(f"LoRA r is {r} but lora_A holds rank {rank_of_a}")
    alpha = values.get("lora_alpha")
    if alpha is None:
        raise ExportError("LoRA checkpoint without lora_train_meta.json: pass --lora-alpha")
    if float(alpha) == 0:
        raise ExportError("lora_alpha is 0, which would erase the adapter; pass the real --lora-alpha")
    return LoraSettings(
        r=r, alpha=int(alpha) if float(alpha).is_integer() else float(alpha), use_rslora=bool(values.get("use_rslora", False)), task_type=values.get("task_type")
    )


def merge_lora(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in float32 (the writer casts to the output dtype afterwards)."""
    return base.float() + scale * (b.float() @ a.float())


def adapter_tensor_name(target: LoraTarget, which: str) -> str:
    """The key PEFT saves an adapter half under (adapter name removed)."""
    return f"{PEFT_PREFIX}{target.module}.lora_{which}.weight"


def adapter_config(settings: LoraSettings, targets: list[LoraTarget], base_model: str | None) -> dict[str, Any]:
    """adapter_config.json content, made by peft's own LoraConfig."""
    from peft import LoraConfig

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        use_rslora=settings.use_rslora,
        target_modules=sorted({target.module.rsplit(".", 1)[-1] for target in targets}),
        task_type=settings.task_type,
        base_model_name_or_path=base_model,
    )
    return config.to_dict()
