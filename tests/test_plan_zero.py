"""rayexport.plan.zero: DeepSpeed ZeRO's partitions laid out here as its engine lays them out
(this test's own writing of the layout), and every parameter put back together from the runs
the planning names. tests/test_deepspeed.py checks the same against DeepSpeed's own saves."""

import math

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.plan.zero import frozen_runs, partitioned_runs, zero3_runs

SHAPES = [{"embed": (97, 35), "q": (40, 35), "norm": (35,), "scalar": ()}, {"head": (97, 35), "bias": (3,)}]


def parameters(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for group in shapes for name, shape in group.items()}


def rebuilt(runs, buffers, shapes):
    """Each parameter from its runs of the ranks' buffers, every element placed once."""
    flat = {name: torch.full((math.prod(shape),), float("nan")) for group in shapes for name, shape in group.items()}
    for rank, rank_runs in runs.items():
        for run in rank_runs:
            target = flat[run.name][run.start:run.start + run.length]
            assert torch.isnan(target).all(), f"{run.name} placed twice"
            target.copy_(buffers[rank][run.buffer][run.at:run.at + run.length])
    return {name: values.view(group[name]) for group in shapes for name, values in flat.items() if name in group}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero12_partitions_split_parameters_between_ranks(world):
    """Each group's parameters end to end, cut into equal partitions, the last rank's saved without its padding."""
    params = parameters(SHAPES)
    buffers = {rank: [] for rank in range(world)}
    partitions = []
    for group in SHAPES:
        vector = torch.cat([params[name].reshape(-1) for name in group])
        size = math.ceil(vector.numel() / world)
        chunks = [vector[rank * size:(rank + 1) * size] for rank in range(world)]
        partitions.append([chunk.numel() for chunk in chunks])
        for rank, chunk in enumerate(chunks):
            buffers[rank].append(chunk)
    runs = partitioned_runs(SHAPES, partitions, None)
    assert rebuilt(runs, buffers, SHAPES).keys() == params.keys()
    for name, tensor in rebuilt(runs, buffers, SHAPES).items():
        assert torch.equal(tensor, params[name]), name
    if world > 1:  # the embedding straddles ranks 0 and 1 (3395 elements, more than a partition)
        assert len([run for rank_runs in runs.values() for run in rank_runs if run.name == "embed"]) > 1


def test_zero12_alignment_padding_is_skipped():
    params = parameters([{"a": (5,), "b": (3,)}])
    vector = torch.cat([params["a"], torch.zeros(3), params["b"]])  # 3 elements of padding after a
    runs = partitioned_runs([{"a": (5,), "b": (3,)}], [[6, 5]], [[3, 0]])
    buffers = {0: [vector[:6]], 1: [vector[6:]]}
    for name, tensor in rebuilt(runs, buffers, [{"a": (5,), "b": (3,)}]).items():
        assert torch.equal(tensor, params[name])


@pytest.mark.parametrize("world,cut", [(2, 0), (3, 700), (4, 1)])
def test_zero3_partitions_each_parameter_and_may_cross_buffers(world, cut):
    """ceil(numel / world) elements of each parameter per rank, the last padded; a rank's buffers
    (one per group) hold its partitions one after another."""
    params = parameters(SHAPES)
    flat_shapes = [{name: shape for group in SHAPES for name, shape in group.items()}]
    partitions = {rank: [] for rank in range(world)}
    for name, tensor in params.items():
        size = math.ceil(tensor.numel() / world)
        padded = torch.cat([tensor.reshape(-1), torch.zeros(size * world - tensor.numel())])
        for rank in range(world):
            partitions[rank].append(padded[rank * size:(rank + 1) * size])
    whole = {rank: torch.cat(chunks) for rank, chunks in partitions.items()}
    total = whole[0].numel()
    sizes = [cut, total - cut] if cut else [total]
    buffers = {rank: list(whole[rank].split(sizes)) for rank in range(world)}
    runs = zero3_runs(flat_shapes, world, sizes)
    for name, tensor in rebuilt(runs, buffers, flat_shapes).items():
        assert torch.equal(tensor, params[name]), name


def test_zero3_buffers_that_do_not_hold_the_partitions_are_one_line():
    with pytest.raises(ExportError, match="partitions take 2 elements of each rank's 3"):
        zero3_runs([{"w": (4,)}], 2, [3])


def test_frozen_parameters_are_partitioned_as_zero3_parameters():
    runs = frozen_runs({"w": (5, 3), "b": (1,)}, 2)
    assert [(run.name, run.buffer, run.start, run.length) for run in runs[1]] == [("w", 0, 8, 7), ("b", 1, 1, 0)]
