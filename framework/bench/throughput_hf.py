"""``sparrow bench throughput --compare-hf``: HF transformers ``generate`` on the benchmark's
workload in this process, and the figures the report compares with the engine's."""

from __future__ import annotations

import argparse
import time
from typing import Any


def compare_hf(model_path: str, workload, args: argparse.Namespace, engine_output_tok_s: float, *,
               trust_remote_code: bool = False, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """HF's figures on the workload, or on its first ``--hf-num-prompts`` prompts. The speed-up is
    stored only when HF ran every prompt: a subset's throughput is a different measurement (a
    smaller batch), and dividing by it once printed 100x where the same workload gave 6x.
    ``trust_remote_code``: the engine's, so HF loads a model whose directory ships its own code."""
    num_prompts = args.hf_num_prompts
    hf_workload = workload[:num_prompts] if num_prompts else workload
    same = len(hf_workload) == len(workload)
    if args.preset == "gpu":
        hf = run_hf(model_path, hf_workload, "cuda", "bfloat16", args.temperature, args.hf_batch_size,
                    trust_remote_code=trust_remote_code, hf_overrides=hf_overrides)
    else:
        hf = run_hf(model_path, hf_workload, batch_size=args.hf_batch_size, trust_remote_code=trust_remote_code,
                    hf_overrides=hf_overrides)
    hf_total = sum(len(p) for p, _ in hf_workload) + hf["output_tokens"]
    figures = {
        "hf_num_prompts": len(hf_workload),
        "hf_batch_size": hf["batch_size"],
        "hf_same_workload": same,
        "hf_elapsed_s": hf["elapsed_s"],
        "hf_output_tok_s": hf["output_tokens"] / hf["elapsed_s"],
        "hf_total_tok_s": hf_total / hf["elapsed_s"],
    }
    if same:
        figures["speedup_vs_hf"] = engine_output_tok_s / figures["hf_output_tok_s"]
    return figures


def run_hf(model_path: str, workload, device: str = "cpu", dtype_name: str = "float32",
           temperature: float = 0.0, batch_size: int | None = None, *,
           trust_remote_code: bool = False, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """HF transformers ``generate`` on the workload in this process: left-padded batches of
    ``batch_size`` prompts (default: one batch of all), one after another, timed together.
    ``trust_remote_code``, ``hf_overrides``: the engine arguments' values, so that HF runs the same model."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    from sparrow.model_loader import get_hf_config

    class CountSteps(StoppingCriteria):
        """Advances the progress bar once per decode step; never stops anything."""

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            bar.update(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    extra = {"config": get_hf_config(model_path, trust_remote_code, hf_overrides)} if hf_overrides else {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype_name), local_files_only=True,
                                                 trust_remote_code=trust_remote_code, **extra).to(device)
    model.eval()
    batch_size = batch_size or len(workload)
    batches = [workload[start:start + batch_size] for start in range(0, len(workload), batch_size)]
    pad_id = 0
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # One bar step per decode step of every batch (the steps HF runs, whatever each request asked).
    bar = tqdm(total=sum(max(m for _, m in batch) for batch in batches), desc="HF generate", unit="step",
               dynamic_ncols=True)
    elapsed = 0.0
    with bar:
        for batch in batches:
            max_len = max(len(p) for p, _ in batch)
            max_new = max(m for _, m in batch)
            input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, (prompt, _) in enumerate(batch):  # left padding
                input_ids[row, max_len - len(prompt):] = torch.tensor(prompt)
                attention_mask[row, max_len - len(prompt):] = 1
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=input_ids, attention_mask=attention_mask,
                               max_new_tokens=max_new, min_new_tokens=max_new, do_sample=temperature > 0,
                               temperature=temperature or None, pad_token_id=pad_id,
                               stopping_criteria=StoppingCriteriaList([CountSteps()]))
            synchronize()
            elapsed += time.perf_counter() - started
    return {"elapsed_s": elapsed, "output_tokens": sum(m for _, m in workload), "batch_size": batch_size}
