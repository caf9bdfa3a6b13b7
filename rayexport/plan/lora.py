"""LoRA / PEFT: recognising adapter keys, their settings, and folding them into base weights.

Pure functions; the merge runs on the exporter once a layer's base weight, A and B are gathered,
and on the workers holding the weight's shards for the verification's reference.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from rayexport.common.errors import ExportError

if TYPE_CHECKING:
    import torch

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
# Elements of W merged at a time: bounds the float32 temporaries of a merge.
MERGE_BLOCK = 1 << 20


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


def lora_settings(meta: dict[str, Any] | None, saved_rank: int, overrides: dict[str, Any]) -> LoraSettings:
    """r, alpha, rsLoRA and task type from `lora_train_meta.json`, overridden by the user's
    options; r defaults to `saved_rank`, the rank the saved adapter has. alpha is never guessed
    and never 0."""
    values = {**(meta or {}), **{key: value for key, value in overrides.items() if value is not None}}
    r = int(values.get("r") or saved_rank)
    if r != saved_rank:
        raise ExportError(f"LoRA r is {r} but the saved adapter has rank {saved_rank}")
    alpha = values.get("lora_alpha")
    if alpha is None:
        raise ExportError("LoRA checkpoint without lora_train_meta.json: pass --lora-alpha")
    if float(alpha) == 0:
        raise ExportError("lora_alpha is 0, which would erase the adapter; pass the real --lora-alpha")
    return LoraSettings(
        r=r, alpha=int(alpha) if float(alpha).is_integer() else float(alpha), use_rslora=bool(values.get("use_rslora", False)), task_type=values.get("task_type")
    )


def fan_in_fan_out_weights(model: torch.nn.Module) -> frozenset[str]:
    """The weights a model stores as (in_features, out_features), the transpose of nn.Linear's:
    those of transformers' Conv1D (GPT-2 and kin), the layers peft merges with fan_in_fan_out."""
    from transformers.pytorch_utils import Conv1D

    return frozenset(f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Conv1D))


def merge_lora(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool = False,
    offset: tuple[int, int] = (0, 0),
) -> Iterator[torch.Tensor]:
    """W + scale * B @ A in float32 (the writer casts to the output dtype afterwards), as
    consecutive blocks of rows; the delta is transposed for a `fan_in_fan_out` weight, stored
    (in, out), as peft merges it. A is (r, in) and B (out, r) whole; `base` is W, or the box of
    W at `offset`, whose merge comes out bit for bit as in the whole W's (a worker holding one
    shard of W can recompute its part of an exported merge exactly). A 1-D `base` with a
    one-element `offset` is a run of W's flattened elements from that element (ZeRO-3's
    partition of W), merged as in the whole W too."""
    if base.dim() == 1 and len(offset) == 1:
        yield from _merge_run(base, a, b, scale, fan_in_fan_out, offset[0])
        return
    top, left = offset
    height, width = base.shape
    rows = max(1, MERGE_BLOCK // max(width, 1))
    for start in range(0, max(height, 1), rows):  # an empty W still gives one (empty) block
        stop = min(start + rows, height)
        if fan_in_fan_out:  # W's rows are A's columns, its columns B's rows
            delta = _lora_delta(b[left:left + width], a[:, top + start:top + stop]).T
        else:
            delta = _lora_delta(b[top + start:top + stop], a[:, left:left + width])
        yield base[start:stop].float() + delta * scale


def _merge_run(
    run: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool, start: int,
) -> Iterator[torch.Tensor]:
    """`merge_lora` of the run of W's flattened elements [start, start + len(run)): the delta of
    each block of the rows it touches, flattened, and the run's part of it added."""
    width = b.shape[0] if fan_in_fan_out else a.shape[1]
    end = start + run.numel()
    if end == start or width == 0:
        yield run.float()
        return
    rows = max(1, MERGE_BLOCK // width)
    last = (end + width - 1) // width
    for top in range(start // width, last, rows):
        bottom = min(top + rows, last)
        delta = _lora_delta(b, a[:, top:bottom]).T if fan_in_fan_out else _lora_delta(b[top:bottom], a)
        low, high = max(start, top * width), min(end, bottom * width)
        yield run[low - start:high - start].float() + delta.reshape(-1)[low - top * width:high - top * width] * scale


def _lora_delta(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B @ A in float32, summed over the rank in order with one rounded product and one rounded
    sum per step, so every element comes out the same whatever block holds it and on any CPU
    (a BLAS matmul's rounding depends on the shapes, the threads and the CPU's kernels, and a
    fused op such as addcmul_ may round differently in its vectorised loop and its tail)."""
    import torch

    b, a = b.float(), a.float()
    delta = torch.zeros(b.shape[0], a.shape[1], dtype=torch.float32)
    term = torch.empty_like(delta)
    for k in range(a.shape[0]):
        torch.mul(b[:, k:k + 1], a[k:k + 1], out=term)
        delta.add_(term)
    return delta


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
