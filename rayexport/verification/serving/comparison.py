"""What the serve check asks of the engine and how it judges the answer: fixed token-id prompts,
the tokens generated after each, and the tolerances (by dtype) within which each generated token
must be transformers' top choice on the same prefix, with the same logprob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayexport.verification import VerificationError

PROMPT_LENGTHS = (4, 7, 10, 13)
GENERATED_TOKENS = 8


@dataclass(frozen=True)
class Tolerance:
    """How far the engine may be from transformers at one position: `top` (transformers' logprob
    of its top choice minus its logprob of the engine's token) and `logprob` (the two engines'
    logprobs of that token)."""

    top: float
    logprob: float


# Fitted to this project's exports (vLLM 0.32 on CPU against transformers, benchmarks/
# vllm_families.py): in float32 the logprobs agree within 1.4e-5; in bfloat16 a near-tie may go
# either way and a tiny MoE's logprobs part by up to 0.31 while its float32 export agrees within
# 1e-5 (a missing weight moves them by several units). float16 is not measured: as bfloat16.
TOLERANCES = {
    "float32": Tolerance(top=1e-3, logprob=1e-3),
    "bfloat16": Tolerance(top=0.1, logprob=0.5),
    "float16": Tolerance(top=0.1, logprob=0.5),
}


def fixed_prompts(vocab_size: int) -> list[list[int]]:
    """The check's prompts: one per PROMPT_LENGTHS, token ids spread over the vocabulary by a
    fixed rule (the same prompts on every run), none of them 0 (often padding)."""
    return [
        [1 + (97 * index + 31 * position * position) % (vocab_size - 1) for position in range(length)]
        for index, length in enumerate(PROMPT_LENGTHS)
    ]


def model_length(prompts: list[list[int]], tokens: int = GENERATED_TOKENS) -> int:
    """The context the engine needs: the longest prompt and the tokens generated after it."""
    return max(len(prompt) for prompt in prompts) + tokens


def compare_sequences(sequences: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """Judge the child's `sequences` (per prompt: the engine's tokens and logprobs, and
    transformers' logprob of each token, top token and top logprob on the same prefix) with the
    tolerance of `dtype`; raise VerificationError naming the first prompt and position where
    the two part, else return what was compared and the largest differences."""
    tolerance = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
    largest_top, largest_logprob, compared = 0.0, 0.0, 0
    for index, sequence in enumerate(sequences):
        rows = zip(sequence["tokens"], sequence["vllm_logprobs"], sequence["hf_logprobs"], sequence["hf_top"], sequence["hf_top_logprobs"])
        for position, (token, engine_logprob, hf_logprob, hf_top, hf_top_logprob) in enumerate(rows):
            below_top, apart = hf_top_logprob - hf_logprob, abs(engine_logprob - hf_logprob)
            where = f"prompt {index} (token ids {sequence['prompt']}), generated position {position}"
            if below_top > tolerance.top:
                raise VerificationError(
                    f"vllm: {where}: vLLM generated token {token}, which transformers puts {below_top:.3g} below its "
                    f"top choice {hf_top} (logprobs {hf_logprob:.4f} and {hf_top_logprob:.4f}); the two engines "
                    f"part there ({dtype} allows {tolerance.top:g})"
                )
            if apart > tolerance.logprob:
                raise VerificationError(
                    f"vllm: {where}: vLLM gives token {token} logprob {engine_logprob:.4f}, transformers "
                    f"{hf_logprob:.4f}, {apart:.3g} apart ({dtype} allows {tolerance.logprob:g})"
                )
            largest_top, largest_logprob, compared = max(largest_top, below_top), max(largest_logprob, apart), compared + 1
    return {
        "prompts": len(sequences), "tokens_compared": compared,
        "largest_logprob_difference": largest_logprob, "largest_below_top": largest_top,
        "tolerance": {"top": tolerance.top, "logprob": tolerance.logprob},
    }
