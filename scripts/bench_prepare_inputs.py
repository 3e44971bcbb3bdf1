"""Host time of the model runner's step-input preparation: before and after persistent buffers.

    python scripts/bench_prepare_inputs.py [--rows 64 256] [--prefill 512] [--calls 200] [--threads 1]

For each row count: ``rows`` decode rows (1,000 tokens of context each) plus one prefill row whose
``--prefill``-token chunk continues a 2,048-token prompt (0: decode only). One line per variant,
the median and the best of ``--calls`` calls of ``prepare_inputs``, in microseconds:

* rebuild: the former preparation (fresh numpy arrays each step, wrapped with ``torch.from_numpy``
  on the CPU), kept here as the baseline;
* buffers: ``ModelRunner.prepare_inputs`` with the persistent buffers, zero-copy (the CPU path);
* buffers+copy: the same with separate device tensors (the CUDA path's packing, one copy and the
  incremental block-table update, run on the CPU: the copy is a CPU memcpy here).

The CPU runner's token padding applies to all three. Nothing runs on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from sparrow.attention import AttentionMetadata
from sparrow.sampling_params import SamplingParams
from sparrow.worker.input_batch import CachedRequestState, InputBatch
from sparrow_cpu.worker import CpuModelRunner

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
DECODE_CONTEXT = 1000
PROMPT = 2048


def make_runner(num_rows: int, prefill: int, separate: bool | None) -> tuple[CpuModelRunner, SimpleNamespace]:
    """A runner with only what prepare_inputs reads (no model), and the step's scheduler output."""
    runner = CpuModelRunner.__new__(CpuModelRunner)
    runner.block_size = BLOCK_SIZE
    runner.device = torch.device("cpu")
    runner.config = SimpleNamespace(max_num_batched_tokens=max(2048, num_rows + prefill))
    runner.separate_device_buffers = separate
    num_reqs = num_rows + (1 if prefill else 0)
    batch = runner.batch = InputBatch(num_reqs, MAX_MODEL_LEN, MAX_MODEL_LEN // BLOCK_SIZE)
    rng = np.random.default_rng(0)
    next_block = 1
    scheduled = {}
    for row in range(num_reqs):
        is_prefill = prefill and row == num_reqs - 1
        num_tokens = PROMPT if is_prefill else DECODE_CONTEXT
        computed = prefill if is_prefill else DECODE_CONTEXT - 1
        count = prefill if is_prefill else 1
        blocks = -(-(computed + count) // BLOCK_SIZE)
        state = CachedRequestState(
            req_id=f"r{row}", prompt_token_ids=rng.integers(1, 30000, num_tokens).tolist(),
            sampling_params=SamplingParams(), block_ids=list(range(next_block, next_block + blocks)),
            num_computed_tokens=computed)
        next_block += blocks
        batch.add(state)
        scheduled[state.req_id] = count
    return runner, SimpleNamespace(num_scheduled_tokens=scheduled)


def rebuild_prepare_inputs(runner: CpuModelRunner, so: SimpleNamespace) -> tuple:
    """The preparation before persistent buffers (single KV cache group), for the baseline."""
    batch, block_size = runner.batch, runner.block_size
    num_reqs = batch.num_reqs
    num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in batch.req_ids), dtype=np.int64, count=num_reqs)
    cu_num_tokens = np.cumsum(num_scheduled)
    total = int(cu_num_tokens[-1])
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = cu_num_tokens
    rows = np.repeat(np.arange(num_reqs), num_scheduled)
    offsets = np.arange(total) - np.repeat(query_start_loc[:-1].astype(np.int64), num_scheduled)
    num_computed = batch.num_computed_tokens[:num_reqs]
    positions = num_computed[rows] + offsets
    input_ids = batch.token_ids[rows, positions]
    block_ids = batch.block_table[rows, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + positions % block_size
    padded = runner.padded_num_tokens(total)
    if padded > total:
        input_ids = np.concatenate([input_ids, np.zeros(padded - total, dtype=input_ids.dtype)])
        positions = np.concatenate([positions, np.zeros(padded - total, dtype=positions.dtype)])
        slot_mapping = np.concatenate([slot_mapping, np.full(padded - total, -1, dtype=np.int64)])
    seq_lens = (num_computed + num_scheduled).astype(np.int32)
    max_blocks = int(batch.num_blocks[:num_reqs].max())
    complete_rows = seq_lens >= batch.num_tokens[:num_reqs]

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))

    metadata = AttentionMetadata(
        num_actual_tokens=total, num_reqs=num_reqs, max_query_len=int(np.diff(query_start_loc).max()),
        max_seq_len=int(seq_lens.max()), query_start_loc=to_device(query_start_loc), seq_lens=to_device(seq_lens),
        block_table=to_device(batch.block_table[:num_reqs, :max_blocks]), slot_mapping=to_device(slot_mapping),
        query_start_loc_cpu=torch.from_numpy(query_start_loc), seq_lens_cpu=torch.from_numpy(seq_lens),
        is_decode_only=bool(total == num_reqs))
    batch.num_computed_tokens[:num_reqs] += num_scheduled
    return to_device(input_ids), to_device(positions), metadata, to_device(cu_num_tokens - 1), complete_rows


def time_variants(variants: list, calls: int) -> list[tuple[float, float]]:
    """Median and best microseconds per variant. The variants take turns call by call, so that
    a busy machine's slow moments fall on all of them alike."""
    saved = [runner.batch.num_computed_tokens.copy() for runner, _, _ in variants]
    times: list[list[float]] = [[] for _ in variants]
    for call in range(calls + 10):  # the first ones warm up (lazy buffers, caches)
        for index, (runner, so, prepare) in enumerate(variants):
            started = time.perf_counter()
            prepare(runner, so)
            elapsed = time.perf_counter() - started
            runner.batch.num_computed_tokens[:] = saved[index]
            if call >= 10:
                times[index].append(elapsed)
    return [(statistics.median(t) * 1e6, min(t) * 1e6) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = [("rebuild", None, rebuild_prepare_inputs), ("buffers", None, CpuModelRunner.prepare_inputs),
                ("buffers+copy", True, CpuModelRunner.prepare_inputs)]
    print(f"{'rows':>5} {'prefill':>7} {'variant':<13} {'median us':>10} {'best us':>9}")
    for prefill in args.prefill:
        for rows in args.rows:
            runs = [(*make_runner(rows, prefill, separate), prepare) for _, separate, prepare in variants]
            for (name, _, _), (median, best) in zip(variants, time_variants(runs, args.calls)):
                print(f"{rows:>5} {prefill:>7} {name:<13} {median:>10.1f} {best:>9.1f}")


if __name__ == "__main__":
    main()
