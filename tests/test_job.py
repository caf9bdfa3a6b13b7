"""Orchestration choices that need no cluster. No GPU exists on the test machines, so the GPU
counts here are given, not detected: the NCCL path itself runs only where a GPU is lent."""

from rayexport.job import choose_backend, verify_level
from rayexport.options import FULL_VERIFY_LIMIT


def test_auto_backend_takes_nccl_only_with_a_gpu_per_worker():
    assert choose_backend("auto", gpus_in_cluster=4, num_workers=4) == "nccl"
    assert choose_backend("auto", gpus_in_cluster=2, num_workers=4) == "gloo"
    assert choose_backend("auto", gpus_in_cluster=0, num_workers=1) == "gloo"


def test_zero_gpus_per_worker_keeps_an_export_off_the_gpus():
    assert choose_backend("auto", gpus_in_cluster=8, num_workers=2, gpus_per_worker=0) == "gloo"


def test_explicit_backend_wins():
    assert choose_backend("gloo", gpus_in_cluster=8, num_workers=2) == "gloo"
    assert choose_backend("nccl", gpus_in_cluster=0, num_workers=2) == "nccl"


def test_auto_verification_is_full_for_models_that_fit():
    assert verify_level("auto", FULL_VERIFY_LIMIT) == "full"
    assert verify_level("auto", FULL_VERIFY_LIMIT + 1) == "quick"
    assert verify_level("none", 10) == "none"
