"""Checkpoint layouts: what a checkpoint prefix holds and how a worker reads its part."""
