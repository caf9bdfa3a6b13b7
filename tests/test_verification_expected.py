"""What an export must hold: the quick level's sample of tensors."""

from __future__ import annotations

from rayexport.verification.expected import QUICK_SAMPLE, ExpectedExport


def test_a_quick_sample_always_holds_a_lora_merged_tensor():
    names = [f"layers.{index}.weight" for index in range(3 * QUICK_SAMPLE)]
    plain = ExpectedExport(files={}, tensors=dict.fromkeys(names, {}), level="quick").sample()
    merged = sorted(set(names) - set(plain))[0]
    pieces = {merged: [{"lora": True}], plain[0]: [{}]}
    sample = ExpectedExport(files={}, tensors=dict.fromkeys(names, {}), pieces=pieces, level="quick").sample()
    assert merged in sample and len(sample) == QUICK_SAMPLE and set(sample) - {merged} < set(plain)
