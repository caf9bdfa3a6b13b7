"""rayexport.orchestration.report: the summary a person reads says each thing once, and only what is true."""

from __future__ import annotations

from rayexport.orchestration.report import ExportReport, timed_stage
from rayexport.plan.naming import choose_dtype


def summary(**fields) -> str:
    dtype, reason = choose_dtype("auto", "float32")
    base = dict(
        source="/ckpt", destination="/out", manifest="/out/export_manifest.json", layout="verl", world_size=2,
        workers=2, backend="gloo", tensor_count=3, naming="in-memory", format="on-disk", dtype=dtype, dtype_reason=reason,
        seconds={"imports": 0.5, "ray_start": 5.0, "load": 1.0, "ray_stop": 1.2},
        verification={"passed": True, "level": "full", "checks": {"files": {}, "reload": {}}},
    )
    return ExportReport(**{**base, **fields}).summary()


def test_a_dense_model_is_not_said_to_be_converted():
    text = summary(converted=False)
    assert "  on-disk format; bfloat16 tensors\n" in text
    assert "converted" not in text and "in-memory" not in text


def test_a_converted_checkpoint_says_from_which_names():
    assert "  on-disk format, converted from in-memory names; bfloat16 tensors\n" in summary(converted=True)


def test_the_dtype_reason_is_one_plain_sentence_left_to_the_log_and_the_report():
    _, reason = choose_dtype("auto", "float32")
    assert "(" not in reason and "--dtype float32 keeps float32" in reason
    assert reason not in summary()


def test_every_phase_is_in_the_summary_in_the_order_it_ran_and_a_phase_timed_twice_adds_up():
    seconds: dict[str, float] = {}
    for name in ("imports", "ray_start", "imports"):
        with timed_stage(seconds, name):
            pass
    assert list(seconds) == ["imports", "ray_start"]
    assert "  seconds: imports 0.5, ray_start 5.0, load 1.0, ray_stop 1.2 (total 7.7)\n" in summary()
