"""Source-key normalisation: from the names a training wrapper saved to the model's own names."""

# Components inserted by FSDP1, activation checkpointing and torch.compile wrappers.
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# DDP and some trainers put the whole model under a leading "module.".
LEADING_PREFIX = "module."


def normalize_key(key: str) -> str:
    """Strip wrapper components from a state-dict key, e.g.
    `_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight`
    -> `model.layers.0.mlp.up_proj.weight`."""
    if key.startswith(LEADING_PREFIX):
        key = key[len(LEADING_PREFIX):]
    return ".".join(part for part in key.split(".") if part not in WRAPPER_COMPONENTS)
