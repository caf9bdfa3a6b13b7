"""The vLLM check's process: `PYTHON vllm_child.py REQUEST.json`, run by a Python that has vLLM
(which pins its own torch and transformers, so it often lives in an environment of its own,
without rayexport). It therefore imports nothing from rayexport: only the standard library,
then torch, vLLM and transformers.

The request (JSON) names the export's local folder, its dtype, the token-id prompts, the
tokens to generate, `trust_remote_code` and the result file. The child builds vLLM's engine on the
folder, generates greedily, frees the engine, then has transformers score each generated
sequence on the same folder (one forward pass over prompt + tokens): per generated position,
vLLM's token and logprob, transformers' logprob of that token, and transformers' top token and
its logprob. The result file gets {"result": {...}} or {"error": {"stage": ..., "message": ...}};
what the libraries print goes to stdout and stderr.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# vLLM on CPU, in the few GiB a check may take: a 1 GiB KV cache, the engine in this process
# (building it takes seconds, not the half minute a separate engine process takes), no pinning
# of OpenMP threads to cores (the export's own processes share them).
CPU_SETTINGS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def one_line(error: BaseException) -> str:
    """An exception as one line, its type first."""
    return " ".join(f"{type(error).__name__}: {error}".split())


def build_engine(request: dict, on_gpu: bool):
    """vLLM's engine on the export's folder: on a GPU with vLLM's defaults, on CPU with the
    small settings above; prompts are token ids, so the tokenizer loads only where the export
    carries one (which proves vLLM can load it)."""
    from vllm import LLM

    folder = request["folder"]
    has_tokenizer = any(os.path.exists(os.path.join(folder, name)) for name in TOKENIZER_FILES)
    settings = dict(
        model=folder, dtype=request["dtype"], seed=0, trust_remote_code=request["trust_remote_code"],
        skip_tokenizer_init=not has_tokenizer, max_model_len=request["max_model_len"],
    )
    if not on_gpu:
        settings.update(enforce_eager=True, max_num_seqs=len(request["prompts"]))
    return LLM(**settings)


def generate(llm, request: dict) -> list[dict]:
    """Greedy generation of `tokens` tokens after each prompt, each with its logprob (vLLM's
    raw logprobs: before any sampling adjustment)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=request["tokens"], logprobs=1, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in request["prompts"]], params, use_tqdm=False)
    sequences = []
    for prompt, output in zip(request["prompts"], outputs):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [step[token].logprob for token, step in zip(tokens, completion.logprobs)]
        sequences.append({"prompt": prompt, "tokens": tokens, "vllm_logprobs": logprobs})
    return sequences


def score_with_transformers(request: dict, sequences: list[dict], device: str) -> None:
    """transformers' logprobs on vLLM's prefixes, added to each sequence: of vLLM's token
    (`hf_logprobs`) and of its own top choice (`hf_top`, `hf_top_logprobs`)."""
    import torch
    import transformers

    folder, trust = request["folder"], request["trust_remote_code"]
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust)
    auto = transformers.AutoModelForCausalLM
    if type(config) not in auto._model_mapping and not trust:
        auto = transformers.AutoModelForImageTextToText
    model = auto.from_pretrained(folder, dtype="auto", trust_remote_code=trust).to(device).eval()
    with torch.no_grad():
        for sequence in sequences:
            prompt, tokens = sequence["prompt"], sequence["tokens"]
            ids = torch.tensor([prompt + tokens], device=device)
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            rows = logprobs[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
            top = rows.max(dim=-1)
            sequence["hf_logprobs"] = [float(row[token]) for row, token in zip(rows, tokens)]
            sequence["hf_top"] = [int(index) for index in top.indices]
            sequence["hf_top_logprobs"] = [float(value) for value in top.values]


def peak_rss_bytes() -> int:
    """This process's peak resident memory."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check(request: dict) -> dict:
    """The check's steps, each timed; an {"error": ...} naming the stage that failed."""
    started = time.time()
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        for key, value in CPU_SETTINGS.items():
            os.environ.setdefault(key, value)
    try:
        import vllm
    except Exception as error:  # noqa: BLE001 - a broken install raises more than ImportError
        return {"error": {"stage": "import", "message": one_line(error)}}
    imported = time.time()
    try:
        llm = build_engine(request, on_gpu)
    except Exception as error:  # noqa: BLE001 - the engine raises anything; its text is the reason
        return {"error": {"stage": "load", "message": one_line(error), "version": vllm.__version__}}
    loaded = time.time()
    dtype = str(llm.model_config.dtype).removeprefix("torch.")
    try:
        sequences = generate(llm, request)
    except Exception as error:  # noqa: BLE001 - a kernel the model needs may be missing
        return {"error": {"stage": "generate", "message": one_line(error), "version": vllm.__version__}}
    generated = time.time()
    del llm
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    try:
        score_with_transformers(request, sequences, "cuda" if on_gpu else "cpu")
    except Exception as error:  # noqa: BLE001 - from_pretrained raises anything
        return {"error": {"stage": "score", "message": one_line(error), "version": vllm.__version__}}
    return {"result": {
        "engine": "vllm", "version": vllm.__version__, "device": "cuda" if on_gpu else "cpu", "dtype": dtype,
        "sequences": sequences, "imports_s": round(imported - started, 3), "load_s": round(loaded - imported, 3),
        "generate_s": round(generated - loaded, 3), "score_s": round(time.time() - generated, 3),
        "peak_rss_bytes": peak_rss_bytes(),
    }}


def main() -> int:
    """Read the request named on the command line, run the check, write its outcome."""
    with open(sys.argv[1]) as handle:
        request = json.load(handle)
    outcome = check(request)
    with open(request["result_file"], "w") as handle:
        json.dump(outcome, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
