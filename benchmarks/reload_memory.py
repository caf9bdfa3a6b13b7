"""Wall time and memory of the reload check: `from_pretrained` in memory against the streamed
reload, on one export of a random Llama built from its config (no download).

    python benchmarks/reload_memory.py                      # about 1 GB of float32 weights
    python benchmarks/reload_memory.py --gb 4 --dtype bfloat16 --bound-mib 256

Each reload runs in its own process (as an export's verification runs it); the table gives
its wall time as the parent sees it, and the child's peak RSS above its start-up footprint
(after its imports). The logits digests must agree. Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # support: tiny model configs

MiB = 2**20


def write_export(folder: str, gb: float, dtype: str) -> int:
    """A local export of a random Llama of about `gb` GB: config, tokenizer, sharded weights;
    returns the bytes of its weights."""
    import torch

    from rayexport.model.description import model_class
    from support.models import sized_llama_config, write_hf_folder

    config = sized_llama_config(int(gb * 1e9), hidden_size=1024, vocab_size=32000, dtype=dtype)
    write_hf_folder(config, folder)
    torch.manual_seed(0)
    model = model_class(config).build(config, False)
    model.save_pretrained(folder, max_shard_size="500MB")
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="weights of the model (default 1)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bound-mib", type=int, default=256, help="memory bound of the streamed reload (default 256)")
    args = parser.parse_args()

    from rayexport.storage.store import Store
    from rayexport.verification.expected import ExpectedExport
    from rayexport.verification.reload.parent import check_reload

    with tempfile.TemporaryDirectory(prefix="reload-memory-") as folder:
        weights = write_export(folder, args.gb, args.dtype)
        print(f"| {weights / 1e9:.2f} GB of {args.dtype} weights | seconds | peak above start-up | start-up | logits sha256 or reason |")
        print("| --- | --- | --- | --- | --- |")
        for bound in (2 * weights, args.bound_mib * MiB):
            started = time.perf_counter()
            result = check_reload(Store(folder), ExpectedExport(files={}, tensors={}), 3600, bound)
            seconds = time.perf_counter() - started
            above = (result["peak_rss_bytes"] - result["startup_rss_bytes"]) / MiB
            detail = result["logits_sha256"][:16] if "logits_sha256" in result else result.get("reason", "")
            print(
                f"| {result['mode']} (bound {bound / MiB:.0f} MiB) | {seconds:.1f} | {above:.0f} MiB "
                f"| {result['startup_rss_bytes'] / MiB:.0f} MiB | {detail} |"
            )


if __name__ == "__main__":
    main()
