"""What the reload's child checks on a model, whichever mode loaded it: the model built from the
export's config on the meta device, its keys against the export's, its ties, and a forward pass."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def build_skeleton(path: str, trust_remote_code: bool):
    """The export's config and its model in eval mode, every parameter on the meta device (no
    memory) and ties made as `from_pretrained` makes them; buffers are computed for real, since
    a non-persistent one (rotary frequencies) is in no file. The weights' initialisation, which
    would only fill meta tensors (0.3 s for 88 layers), is skipped as `from_pretrained` skips it:
    transformers does so by replacing torch's init functions for every thread of the process,
    which only this process of a single thread may do (never the driver, whose model description
    runs beside other threads)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from rayexport.model.description import model_class

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = model_class(config).build(config, trust_remote_code)
    model.tie_weights()
    return config, model.eval()


def no_init_weights():
    """transformers' context that skips the weights' initialisation (moved in version 5)."""
    try:
        from transformers.initialization import no_init_weights as skipping
    except ImportError:
        from transformers.modeling_utils import no_init_weights as skipping
    return skipping()


def model_formats_of(model: torch.nn.Module, tied: list[tuple[str, str]]):
    """The model's in-memory and on-disk namings (`tied` are in-memory names)."""
    from rayexport.model.conversion import model_formats
    from rayexport.model.description import expected_tensors

    return model_formats(model, expected_tensors(model), {alias: canonical for canonical, alias in tied})


def key_differences(naming, found: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """Missing, unexpected and mismatched (shape) keys of the tensors `found` against a naming
    of the model, whose tied aliases the export does not hold."""
    wanted = {name: tuple(shape) for name, (shape, _) in naming.expected.items() if name not in naming.aliases}
    return {
        "missing_keys": sorted(set(wanted) - set(found)),
        "unexpected_keys": sorted(set(found) - set(wanted)),
        "mismatched_keys": sorted(key for key in set(wanted) & set(found) if wanted[key] != found[key]),
    }


def table_shapes(table: dict[str, dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the export's table."""
    return {name: tuple(entry["shape"]) for name, entry in table.items()}


def untied_pairs(model: torch.nn.Module, tied: list[tuple[str, str]]) -> list[str]:
    """The tied pairs whose two names are not one tensor in `model` (on the meta device, where
    every data pointer is 0, only the same Parameter counts)."""
    parameters = dict(model.named_parameters(remove_duplicate=False))

    def shared(first: torch.Tensor, second: torch.Tensor) -> bool:
        return first is second or (not first.is_meta and first.data_ptr() == second.data_ptr())

    return [
        f"{canonical}={alias}" for canonical, alias in tied
        if canonical not in parameters or alias not in parameters or not shared(parameters[canonical], parameters[alias])
    ]


def probe(model: torch.nn.Module, config) -> dict[str, Any]:
    """A forward pass on PROMPT_IDS: whether the logits are finite, and their sha256 (equal
    digests: the same logits, bit for bit)."""
    vocab = getattr(config, "vocab_size", None) or max(PROMPT_IDS) + 1
    input_ids = torch.tensor([[token % vocab for token in PROMPT_IDS]])
    inputs = {"input_ids": input_ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = input_ids
    with torch.no_grad():
        output = model(**inputs)
    logits = getattr(output, "logits", None)
    if logits is None:
        return {"logits_finite": None}
    return {
        "logits_finite": bool(torch.isfinite(logits).all()),
        "logits_sha256": hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest(),
    }
