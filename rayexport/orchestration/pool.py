"""Warm worker pools: an export's worker actors, with their process group, kept alive for the
next export of the same shape, so a training loop that exports every checkpoint pays Ray actor
and process-group start-up once.

A pool is a detached named actor (the keeper) holding idle worker groups by shape (workers,
backend, CPUs and GPUs per worker); groups and their placement groups are detached too, so they
outlive the task or driver that started them. The keeper also holds the last model descriptions
its exports derived, so that an export from another process (each command line run with
`--pool`) describes the same model without transformers. `close_pool(name)` removes them all.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rayexport.model.saved import RecentDescriptions

if TYPE_CHECKING:
    from rayexport.model.description import ModelDescription

NAMESPACE = "rayexport"


@dataclass
class IdleGroup:
    """A worker group waiting in a pool: its actors (worker 0 first) and placement group."""

    actors: list
    placement_group: Any


class PoolKeeper:
    """The pool's state (a Ray actor): idle groups by shape (a group is either taken by one
    export or idle here, never both), and recent model descriptions by their folder's key."""

    def __init__(self) -> None:
        self.idle: dict[str, list[IdleGroup]] = {}
        self.described = RecentDescriptions()

    def description(self, key: str) -> ModelDescription | None:
        return self.described.get(key)

    def remember(self, key: str, description: ModelDescription) -> None:
        self.described[key] = description

    def take(self, shape: str) -> IdleGroup | None:
        groups = self.idle.get(shape)
        return groups.pop() if groups else None

    def give(self, shape: str, group: IdleGroup) -> None:
        self.idle.setdefault(shape, []).append(group)

    def drain(self) -> list[IdleGroup]:
        groups = [group for shape_groups in self.idle.values() for group in shape_groups]
        self.idle.clear()
        return groups


class PoolDescriptions:
    """The descriptions a pool's keeper holds, as `describe_model` looks them up."""

    def __init__(self, pool: str) -> None:
        self.keeper = get_keeper(pool)

    def get(self, key: str) -> ModelDescription | None:
        import ray

        return ray.get(self.keeper.description.remote(key))

    def __setitem__(self, key: str, description: ModelDescription) -> None:
        self.keeper.remember.remote(key, description)


def keeper_name(pool: str) -> str:
    return f"rayexport-pool-{pool}"


def get_keeper(pool: str):
    """The pool's keeper, started on first use."""
    import ray

    return ray.remote(PoolKeeper).options(
        name=keeper_name(pool), namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
    ).remote()


def group_shape(size: int, backend: str, cpus: float, gpus: float) -> str:
    return f"{size}x{backend}/cpu{cpus}/gpu{gpus}"


def close_pool(pool: str) -> int:
    """Remove every idle group of `pool` and its keeper; return how many groups were removed.
    Exports running with the pool are not touched: their groups are removed when they end."""
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        keeper = ray.get_actor(keeper_name(pool), namespace=NAMESPACE)
    except ValueError:
        return 0
    groups = ray.get(keeper.drain.remote())
    for group in groups:
        for actor in group.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(group.placement_group)
    ray.kill(keeper)
    return len(groups)
