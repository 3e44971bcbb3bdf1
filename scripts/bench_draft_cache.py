"""How many rows a draft model drafts for when requests share a system prompt, and at what cost.

    python scripts/bench_draft_cache.py [--model DIR] [--num-prompts 32] [--num-kv-blocks 64 256]

One engine per cache size, the built-in sparrow-tiny as target and its first layer as the draft
(``sparrow.tiny.draft.build_draft_dir``; random weights, so few drafts are accepted: this measures
coverage, not a speed-up), ``num_speculative_tokens=3``, prefix caching on. The prompts share a
system prompt of about 70 tokens and differ in their last words; greedy, 32 tokens each.

Prints, per cache size: wall time of the batch, draft tokens proposed and accepted, rows that got
no drafts in a step for want of draft blocks (``num_rows_without_room``) and preemptions. A draft
cache without prefix sharing runs out before the target's (each request holds its own copy of
the shared prompt); with it, rows go without drafts only when the target's own cache is short.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sparrow import LLM, SamplingParams
from sparrow.tiny.draft import build_draft_dir
from sparrow.tiny.model import get_builtin_model_path

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 6


def run(model: str, draft: str, num_prompts: int, num_kv_blocks: int) -> str:
    prompts = [SYSTEM + f"Question {i}: what is {i} plus {i}?" for i in range(num_prompts)]
    params = SamplingParams(max_tokens=32, temperature=0)
    llm = LLM(model, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
              multiprocess=False, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True,
              max_num_batched_tokens=512)
    try:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        proposer = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.proposer
        before, rows_before = llm.llm_engine.last_stats, proposer.num_rows_without_room
        assert before is not None
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        stats = llm.llm_engine.last_stats
        assert stats is not None
        drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        return (f"num_kv_blocks={num_kv_blocks:<5} wall={wall:.2f}s drafted={drafted} accepted={accepted} "
                f"rows_without_room={proposer.num_rows_without_room - rows_before} "
                f"preemptions={stats.num_preemptions - before.num_preemptions}")
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target directory (default: the built-in sparrow-tiny)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    model = args.model or str(get_builtin_model_path())
    with tempfile.TemporaryDirectory() as scratch:
        draft = str(build_draft_dir(model, Path(scratch) / "draft", num_layers=1))
        for num_kv_blocks in args.num_kv_blocks:
            print(run(model, draft, args.num_prompts, num_kv_blocks), flush=True)


if __name__ == "__main__":
    main()
