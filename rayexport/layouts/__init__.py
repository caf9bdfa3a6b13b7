"""Checkpoint layouts: what a checkpoint prefix holds and how a worker reads its part."""

# `--layout`'s choices, in the order `auto` tries the layouts (`registry.LAYOUTS`, whose names
# these are); here, so that the command line's options need none of the readers' imports.
AUTO = "auto"
LAYOUT_NAMES = (AUTO, "megatron", "deepspeed", "torchtitan", "dcp", "verl", "accelerate", "hf-sharded")
