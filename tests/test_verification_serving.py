"""The serve check's parts that need no vLLM: its prompts, how it judges two engines' tokens,
its one-line refusals, and how the options ask for it. (`test_serving_vllm.py` runs it on real
exports with vLLM.)"""

from __future__ import annotations

import sys

import pytest

from rayexport.common.errors import ExportError
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.report import serve_lines
from rayexport.storage.store import Store
from rayexport.verification import VerificationError
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.serving import ServeRequest
from rayexport.verification.serving.comparison import (
    GENERATED_TOKENS, PROMPT_LENGTHS, compare_sequences, fixed_prompts, model_length,
)
from rayexport.verification.serving.vllm_check import VllmServe, refusal


def sequence(prompt, tokens, vllm, hf, top, top_logprobs):
    return {"prompt": prompt, "tokens": tokens, "vllm_logprobs": vllm, "hf_logprobs": hf, "hf_top": top,
            "hf_top_logprobs": top_logprobs}


def test_the_prompts_are_fixed_in_the_vocabulary_and_never_padding():
    prompts = fixed_prompts(256)
    assert prompts == fixed_prompts(256) and [len(prompt) for prompt in prompts] == list(PROMPT_LENGTHS)
    assert all(0 < token < 256 for prompt in prompts for token in prompt)
    assert len({tuple(prompt) for prompt in prompts}) == len(prompts)
    assert model_length(prompts) == max(PROMPT_LENGTHS) + GENERATED_TOKENS


def test_tokens_that_are_transformers_top_choices_pass_with_their_largest_differences():
    found = compare_sequences([
        sequence([1, 2], [5, 6], [-0.5, -0.25], [-0.5000004, -0.25], [5, 6], [-0.5000004, -0.25]),
        sequence([3], [7], [-1.0], [-1.0], [9], [-0.9995]),  # a near-tie within float32's tolerance
    ], "float32")
    assert (found["prompts"], found["tokens_compared"]) == (2, 3)
    assert found["largest_logprob_difference"] == pytest.approx(4e-7, abs=1e-9)
    assert found["largest_below_top"] == pytest.approx(5e-4)


def test_the_first_position_where_the_engines_part_is_named():
    parted = [
        sequence([1, 2], [5, 6], [-0.5, -0.3], [-0.5, -0.3], [5, 6], [-0.5, -0.3]),
        sequence([3, 4], [7, 8], [-0.1, -0.2], [-0.1, -2.5], [7, 11], [-0.1, -0.4]),
    ]
    with pytest.raises(VerificationError, match=r"prompt 1 \(token ids \[3, 4\]\), generated position 1: vLLM generated "
                       r"token 8, which transformers puts 2\.1 below its top choice 11"):
        compare_sequences(parted, "bfloat16")
    same_token = [sequence([1], [5], [-0.1], [-0.9], [5], [-0.9])]
    with pytest.raises(VerificationError, match=r"vLLM gives token 5 logprob -0\.1000, transformers -0\.9000, 0\.8 apart "
                       r"\(bfloat16 allows 0\.5\)"):
        compare_sequences(same_token, "bfloat16")
    compare_sequences([sequence([1], [5], [-0.1], [-0.4], [5], [-0.4])], "bfloat16")  # within bfloat16's tolerance
    with pytest.raises(VerificationError):
        compare_sequences([sequence([1], [5], [-0.1], [-0.4], [5], [-0.4])], "float32")


def test_what_stops_the_check_is_one_line_naming_it():
    python = "/opt/serve/bin/python"
    assert refusal({"stage": "import", "message": "ModuleNotFoundError: No module named 'vllm'"}, python) == (
        "vllm: no vLLM in /opt/serve/bin/python (ModuleNotFoundError: No module named 'vllm'); name a Python that has "
        "it with --vllm-python"
    )
    not_loaded = "ValueError: Following weights were not initialized from checkpoint: {'model.norm.weight', 'lm_head.weight'}"
    assert refusal({"stage": "load", "message": not_loaded, "version": "0.32.0"}, python) == (
        "vllm: vLLM 0.32.0 found no tensor in the export for its weight 'lm_head.weight' (and 1 more)"
    )
    unsupported = "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2"
    assert refusal({"stage": "generate", "message": unsupported, "version": "0.32.0"}, python) == (
        "vllm: vLLM 0.32.0 cannot run the export's model: " + unsupported
    )


def test_a_python_without_vllm_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "dtype": "float32"}')
    expected = ExpectedExport(files={}, tensors={}, serve=ServeRequest(python=sys.executable))
    with pytest.raises(VerificationError, match=rf"^vllm: no vLLM in {sys.executable} \(ModuleNotFoundError: No module "
                       r"named 'vllm'\); name a Python that has it with --vllm-python$"):
        VllmServe().run(Store(str(tmp_path)), expected, 120, 0)
    missing = ExpectedExport(files={}, tensors={}, serve=ServeRequest(python=str(tmp_path / "no-python")))
    with pytest.raises(VerificationError, match="does not exist"):
        VllmServe().run(Store(str(tmp_path)), missing, 120, 0)


def test_the_options_ask_for_the_check_and_refuse_a_python_without_it():
    assert ExportOptions(src="a", dst="b").serve is None
    options = ExportOptions(src="a", dst="b", serve_check="vllm", vllm_python="/v/bin/python", serve_check_gpus=2)
    assert options.serve == ServeRequest("vllm", "/v/bin/python", 2.0)
    with pytest.raises(ExportError, match="--vllm-python names the Python of the vLLM check: add --serve-check vllm"):
        ExportOptions(src="a", dst="b", vllm_python="/v/bin/python")
    with pytest.raises(ExportError, match="--serve-check must be one of none, vllm"):
        ExportOptions(src="a", dst="b", serve_check="sglang")


def test_both_commands_refuse_a_python_without_the_check_in_the_same_line_and_exit_code(capsys, tmp_path):
    """Before anything starts (no Ray, nothing read): `rayexport.run` and `rayexport.verify`."""
    from rayexport import run, verify

    line = "rayexport: error: --vllm-python names the Python of the vLLM check: add --serve-check vllm\n"
    assert run.main(["--src", str(tmp_path / "ckpt"), "--dst", str(tmp_path / "out"), "--vllm-python", "/v/bin/python"]) == 1
    assert capsys.readouterr().err == line
    assert verify.main([str(tmp_path / "out"), "--vllm-python", "/v/bin/python"]) == 1
    assert capsys.readouterr().err == line


def test_the_summary_says_what_the_check_compared():
    checks = {"vllm": {"version": "0.32.0", "device": "cpu", "dtype": "float32", "tokens_compared": 32, "prompts": 4,
                       "largest_logprob_difference": 3.8e-6, "load_s": 3.4, "generate_s": 3.6}}
    assert serve_lines(checks) == [
        "  vllm 0.32.0 on cpu (float32): 32 generated tokens from 4 prompts, each transformers' top choice "
        "(largest logprob difference 3.8e-06); load 3.4 s, generate 3.6 s"
    ]
    assert serve_lines({"reload": {}}) == []
