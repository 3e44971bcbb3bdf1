"""Persistent step inputs (sparrow.worker.input_buffers) against a from-scratch rebuild.

The reference is the step preparation the runner had before the buffers: fresh numpy arrays built
with np.repeat / arange / concatenate from the persistent batch. Random sequences of added, removed
and moved rows, appended blocks, chunked prefills and decodes must give the same inputs every step,
with the device tensors as zero-copy views (the CPU default) and as separate tensors updated by
copies (the CUDA path, run here on CPU): there only changed block-table rows may be copied.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.sampling_params import SamplingParams as Params
from sparrow.worker.input_batch import CachedRequestState, InputBatch
from sparrow.worker.input_buffers import InputBuffers

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE


def reference_inputs(batch: InputBatch, num_scheduled: np.ndarray, block_size: int, padded: int) -> dict:
    """The runner's former prepare_inputs, host side, as plain arrays."""
    num_reqs = batch.num_reqs
    cu_num_tokens = np.cumsum(num_scheduled)
    total = int(cu_num_tokens[-1])
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = cu_num_tokens
    rows = np.repeat(np.arange(num_reqs), num_scheduled)
    offsets = np.arange(total) - np.repeat(query_start_loc[:-1].astype(np.int64), num_scheduled)
    num_computed = batch.num_computed_tokens[:num_reqs]
    positions = num_computed[rows] + offsets
    input_ids = batch.token_ids[rows, positions]
    slot_mappings = [table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
                     for table in [batch.block_table, *batch.extra_block_tables]]
    pad = padded - total
    input_ids = np.concatenate([input_ids, np.zeros(pad, dtype=np.int64)])
    positions = np.concatenate([positions, np.zeros(pad, dtype=np.int64)])
    slot_mappings = [np.concatenate([slots, np.full(pad, -1, dtype=np.int64)]) for slots in slot_mappings]
    seq_lens = (num_computed + num_scheduled).astype(np.int32)
    return dict(input_ids=input_ids, positions=positions, slot_mappings=slot_mappings,
                query_start_loc=query_start_loc, seq_lens=seq_lens, logits_indices=cu_num_tokens - 1,
                complete_rows=seq_lens >= batch.num_tokens[:num_reqs], total=total,
                max_query_len=int(num_scheduled.max()), max_seq_len=int(seq_lens.max()))


def snapshot(step) -> dict:
    """Copies of a prepared step's tensors, to check later that they were not overwritten."""
    return {name: getattr(step, name).clone() for name in ("input_ids", "positions", "query_start_loc", "seq_lens",
                                                             "logits_indices", "query_start_loc_cpu")}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.cpu().numpy()


def check_step(step, batch: InputBatch, expected: dict) -> None:
    assert step.num_tokens == expected["total"]
    assert step.max_query_len == expected["max_query_len"] and step.max_seq_len == expected["max_seq_len"]
    np.testing.assert_array_equal(to_numpy(step.input_ids), expected["input_ids"])
    np.testing.assert_array_equal(to_numpy(step.positions), expected["positions"])
    assert len(step.slot_mappings) == len(expected["slot_mappings"])
    for ours, theirs in zip(step.slot_mappings, expected["slot_mappings"]):
        assert ours.dtype == torch.int64
        np.testing.assert_array_equal(to_numpy(ours), theirs)
    for name in ("query_start_loc", "seq_lens", "logits_indices"):
        tensor = getattr(step, name)
        assert tensor.dtype == (torch.int64 if name == "logits_indices" else torch.int32), name
        np.testing.assert_array_equal(to_numpy(tensor), expected[name], err_msg=name)
    np.testing.assert_array_equal(step.query_start_loc_cpu.numpy(), expected["query_start_loc"])
    np.testing.assert_array_equal(step.seq_lens_cpu.numpy(), expected["seq_lens"])
    np.testing.assert_array_equal(step.complete_rows, expected["complete_rows"])
    # Every block a row holds, in every group's table (columns past them are never read).
    host_tables = [batch.block_table, *batch.extra_block_tables]
    host_counts = [batch.num_blocks, *batch.extra_num_blocks]
    for table, host, counts in zip(step.block_tables, host_tables, host_counts):
        assert table.dtype == torch.int32 and table.shape == (batch.num_reqs, MAX_BLOCKS)
        assert table.is_contiguous()
        for row in range(batch.num_reqs):
            n = int(counts[row])
            np.testing.assert_array_equal(to_numpy(table[row, :n]), host[row, :n], err_msg=f"row {row}")


class Simulation:
    """A persistent batch driven like the runner drives it, with random requests and steps."""

    def __init__(self, seed: int, num_groups: int, max_num_reqs: int = 8) -> None:
        self.rng = random.Random(seed)
        self.batch = InputBatch(max_num_reqs, MAX_MODEL_LEN, MAX_BLOCKS, num_kv_cache_groups=num_groups)
        self.num_groups = num_groups
        self.next_block = 1
        self.next_id = 0
        self.waiting: list[CachedRequestState] = []  # removed (unscheduled or preempted) requests

    def new_blocks(self, count: int) -> list[int]:
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks

    def add(self) -> None:
        rng = self.rng
        if self.waiting and rng.random() < 0.5:
            state = self.waiting.pop(rng.randrange(len(self.waiting)))  # resumed where it stopped
        else:
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))]
            computed = rng.choice([0, 0, BLOCK_SIZE * rng.randint(0, (len(prompt) - 1) // BLOCK_SIZE)])
            blocks = -(-computed // BLOCK_SIZE)
            state = CachedRequestState(
                req_id=f"r{self.next_id}", prompt_token_ids=prompt, sampling_params=Params(),
                block_ids=self.new_blocks(blocks), num_computed_tokens=computed,
                extra_group_block_ids=[self.new_blocks(blocks) for _ in range(self.num_groups - 1)])
            self.next_id += 1
        self.batch.add(state)

    def remove(self) -> None:
        row = self.rng.randrange(self.batch.num_reqs)
        state = self.batch.states[row]
        self.batch.remove(state.req_id)  # the last row moves into the hole
        if self.rng.random() < 0.5:
            self.waiting.append(state)

    def schedule(self) -> np.ndarray:
        """Tokens per row (a chunk of a prefill, or one decode), blocks appended to cover them."""
        batch, rng = self.batch, self.rng
        num_scheduled = np.zeros(batch.num_reqs, dtype=np.int64)
        for row in range(batch.num_reqs):
            computed, tokens = int(batch.num_computed_tokens[row]), int(batch.num_tokens[row])
            remaining = max(1, tokens - computed)
            count = min(remaining, rng.choice([1, 3, 8, 64]), MAX_MODEL_LEN - computed)
            num_scheduled[row] = count
            needed = -(-(computed + count) // BLOCK_SIZE) - int(batch.num_blocks[row])
            if needed > 0:
                batch.append_blocks(row, self.new_blocks(needed))
                batch.append_extra_group_blocks(row, [self.new_blocks(needed) for _ in range(self.num_groups - 1)])
        return num_scheduled

    def finish_step(self, num_scheduled: np.ndarray, complete_rows: np.ndarray) -> None:
        batch = self.batch
        batch.num_computed_tokens[:batch.num_reqs] += num_scheduled
        for row in np.flatnonzero(complete_rows):
            state = batch.states[row]
            token = self.rng.randrange(1, 1000)
            state.output_token_ids.append(token)
            batch.append_token(row, token)
        for row in reversed(range(batch.num_reqs)):  # requests near max_model_len finish
            if batch.num_tokens[row] >= MAX_MODEL_LEN - 1:
                batch.remove(batch.req_ids[row])

    def keep_states_in_step(self) -> None:
        """What the runner's states carry for a request resumed later: its progress and blocks."""
        batch = self.batch
        for row, state in enumerate(batch.states):
            state.num_computed_tokens = int(batch.num_computed_tokens[row])
            state.block_ids = batch.block_table[row, :batch.num_blocks[row]].tolist()
            state.extra_group_block_ids = [table[row, :num_blocks[row]].tolist() for table, num_blocks
                                           in zip(batch.extra_block_tables, batch.extra_num_blocks)]


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_steps_match_a_rebuild(seed, num_groups):
    sim = Simulation(seed, num_groups)
    batch = sim.batch
    max_tokens = 8 * 64
    zero_copy = InputBuffers(batch, max_tokens, BLOCK_SIZE, torch.device("cpu"))
    copied = InputBuffers(batch, max_tokens, BLOCK_SIZE, torch.device("cpu"), separate_device=True)
    assert not zero_copy.separate_device and copied.separate_device
    packed_rows: list[int] = []
    pack = copied._pack_table_rows

    def counting_pack(host, start, changed, width):
        packed_rows.append(len(changed))
        return pack(host, start, changed, width)

    copied._pack_table_rows = counting_pack
    previous: list = []
    decode_steps_without_changes = 0
    for _ in range(300):
        for _ in range(sim.rng.choice([0, 0, 0, 1, 2])):
            if batch.num_reqs < batch.max_num_reqs:
                sim.add()
        if batch.num_reqs > 1 and sim.rng.random() < 0.2:
            sim.remove()
        if batch.num_reqs == 0:
            sim.add()
        versions_before = batch.row_version[:batch.num_reqs].copy()
        num_scheduled = sim.schedule()
        total = int(num_scheduled.sum())
        padded = total + sim.rng.choice([0, 0, 5])
        expected = reference_inputs(batch, num_scheduled, BLOCK_SIZE, padded)
        packed_before = len(packed_rows)
        steps = [buffers.prepare(num_scheduled, padded) for buffers in (zero_copy, copied)]
        for step in steps:
            check_step(step, batch, expected)
        # Only rows whose tables changed since the previous step were copied.
        changed = int((batch.row_version[:batch.num_reqs] != copied.synced_version[:batch.num_reqs]).sum())
        assert changed == 0
        if len(packed_rows) > packed_before:
            assert packed_rows[-1] <= batch.num_reqs
        if total == batch.num_reqs and np.array_equal(versions_before, batch.row_version[:batch.num_reqs]) \
                and previous:
            decode_steps_without_changes += 1
        # The previous step's tensors survive this step's preparation (two alternating sets).
        for old_step, old_values in previous:
            for name, value in old_values.items():
                assert torch.equal(getattr(old_step, name), value), name
        previous = [(step, snapshot(step)) for step in steps]
        sim.finish_step(num_scheduled, expected["complete_rows"])
        sim.keep_states_in_step()
    assert sum(packed_rows) < 300 * batch.max_num_reqs / 2  # far fewer rows than a full copy per step


def test_unchanged_rows_are_not_copied():
    sim = Simulation(5, num_groups=1, max_num_reqs=4)
    batch = sim.batch
    for _ in range(4):
        sim.add()
    buffers = InputBuffers(batch, 256, BLOCK_SIZE, torch.device("cpu"), separate_device=True)
    num_scheduled = sim.schedule()
    buffers.prepare(num_scheduled, int(num_scheduled.sum()))
    sim.finish_step(num_scheduled, np.ones(batch.num_reqs, dtype=bool))
    # A step whose blocks already cover it copies no row; one appended block copies one row.
    for row in range(batch.num_reqs):
        batch.append_blocks(row, sim.new_blocks(MAX_BLOCKS - int(batch.num_blocks[row])))
    table = buffers.device_tables[0]
    buffers.prepare(np.ones(batch.num_reqs, dtype=np.int64), batch.num_reqs)
    before = table.clone()
    batch.block_table[2, 0] = 999  # written behind the batch's back: not a change it reports
    buffers.prepare(np.ones(batch.num_reqs, dtype=np.int64), batch.num_reqs)
    assert torch.equal(table, before)
    batch.remove(batch.req_ids[0])  # the last row moves into row 0
    step = buffers.prepare(np.ones(batch.num_reqs, dtype=np.int64), batch.num_reqs)
    assert int(table[0, 0]) == int(batch.block_table[0, 0])
    assert torch.equal(table[1:3], before[1:3])
    assert step.block_tables[0].shape == (3, MAX_BLOCKS)


def test_a_set_is_refilled_only_after_its_steps_work():
    """The event protocol of the CUDA path, with a recording event: a set's event is recorded
    when the next step begins (all of its step's work enqueued) and waited on before the set is
    filled again, two steps later."""
    sim = Simulation(8, num_groups=1)
    for _ in range(3):
        sim.add()
    buffers = InputBuffers(sim.batch, 256, BLOCK_SIZE, torch.device("cpu"), separate_device=True)
    log: list[tuple[str, int]] = []

    class RecordingEvent:
        def __init__(self, index: int) -> None:
            self.index = index

        def record(self) -> None:
            log.append(("record", self.index))

        def synchronize(self) -> None:
            log.append(("wait", self.index))

    for index, step_set in enumerate(buffers.sets):
        step_set.event = RecordingEvent(index)
    per_step = []
    for _ in range(4):
        num_scheduled = sim.schedule()
        buffers.prepare(num_scheduled, int(num_scheduled.sum()))
        per_step.append(list(log))
        log.clear()
        sim.finish_step(num_scheduled, np.ones(sim.batch.num_reqs, dtype=bool))
    assert per_step == [[], [("record", 0)], [("record", 1), ("wait", 0)], [("record", 0), ("wait", 1)]]


def test_zero_token_rows_are_refused():
    sim = Simulation(6, num_groups=1)
    sim.add()
    sim.add()
    buffers = InputBuffers(sim.batch, 64, BLOCK_SIZE, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="scheduled token"):
        buffers.prepare(np.array([0, 2], dtype=np.int64), 2)


def test_buffers_grow_past_the_token_budget():
    sim = Simulation(7, num_groups=2)
    for _ in range(3):
        sim.add()
    buffers = InputBuffers(sim.batch, 4, BLOCK_SIZE, torch.device("cpu"), separate_device=True)
    num_scheduled = sim.schedule()
    padded = int(num_scheduled.sum()) + 3
    expected = reference_inputs(sim.batch, num_scheduled, BLOCK_SIZE, padded)
    check_step(buffers.prepare(num_scheduled, padded), sim.batch, expected)


# -- the engine ---------------------------------------------------------------------------------

def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def run_checked(model_dir: str, prompts: list[list[int]], separate: bool,
                async_scheduling: bool = False) -> tuple[list[list[int]], int, int]:
    """Greedy tokens with chunked prefill and preemption forced; every step's inputs checked
    against the rebuild."""
    llm = LLM(model_dir, multiprocess=False, dtype="float32", max_model_len=256, max_num_batched_tokens=32,
              num_kv_blocks=12, block_size=16, enable_prefix_caching=False, async_scheduling=async_scheduling)
    runner = runner_of(llm)
    runner.separate_device_buffers = separate
    prepare = runner.prepare_inputs
    steps = [0]

    def checked(so):
        batch = runner.batch
        num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in batch.req_ids), dtype=np.int64,
                                    count=batch.num_reqs)
        total = int(num_scheduled.sum())
        expected = reference_inputs(batch, num_scheduled, runner.block_size, runner.padded_num_tokens(total))
        inputs = prepare(so)
        np.testing.assert_array_equal(inputs.input_ids.numpy(), expected["input_ids"])
        np.testing.assert_array_equal(inputs.positions.numpy(), expected["positions"])
        np.testing.assert_array_equal(inputs.metadata.slot_mapping.numpy(), expected["slot_mappings"][0])
        np.testing.assert_array_equal(inputs.metadata.seq_lens.numpy(), expected["seq_lens"])
        np.testing.assert_array_equal(inputs.metadata.query_start_loc.numpy(), expected["query_start_loc"])
        np.testing.assert_array_equal(inputs.logits_indices.numpy(), expected["logits_indices"])
        assert inputs.metadata.is_decode_only == (total == batch.num_reqs)
        steps[0] += 1
        return inputs

    runner.prepare_inputs = checked
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        preemptions = llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions
    finally:
        llm.shutdown()
    assert runner.input_buffers().separate_device == separate
    return [o.outputs[0].token_ids for o in outputs], steps[0], preemptions


def test_engine_tokens_equal_with_copied_buffers(qwen3_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 3000) for _ in range(n)] for n in (5, 40, 70, 3, 100, 17)]
    zero_copy, steps, preemptions = run_checked(qwen3_dir, prompts, separate=False)
    copied, _, _ = run_checked(qwen3_dir, prompts, separate=True)
    overlapped, _, _ = run_checked(qwen3_dir, prompts, separate=True, async_scheduling=True)
    assert steps > 20 and preemptions > 0
    assert copied == zero_copy
    assert overlapped == zero_copy
    assert all(len(tokens) == 12 for tokens in zero_copy)


# -- CUDA (skipped without a GPU) ----------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("num_groups", [1, 2])
def test_random_steps_on_cuda(num_groups):
    """The pinned, copied path on a GPU: every step against the rebuild, after a sync."""
    sim = Simulation(11, num_groups)
    buffers = InputBuffers(sim.batch, 8 * 64, BLOCK_SIZE, torch.device("cuda"))
    assert buffers.separate_device and buffers.sets[0].host.is_pinned()
    for _ in range(200):
        if sim.batch.num_reqs < sim.batch.max_num_reqs and sim.rng.random() < 0.3:
            sim.add()
        if sim.batch.num_reqs > 1 and sim.rng.random() < 0.15:
            sim.remove()
        if sim.batch.num_reqs == 0:
            sim.add()
        num_scheduled = sim.schedule()
        padded = int(num_scheduled.sum()) + sim.rng.choice([0, 3])
        expected = reference_inputs(sim.batch, num_scheduled, BLOCK_SIZE, padded)
        step = buffers.prepare(num_scheduled, padded)
        assert step.input_ids.is_cuda and step.block_tables[0].is_cuda and not step.seq_lens_cpu.is_cuda
        torch.cuda.synchronize()
        check_step(step, sim.batch, expected)
        sim.finish_step(num_scheduled, expected["complete_rows"])
        sim.keep_states_in_step()


@pytest.mark.cuda
def test_pinned_buffers_are_not_refilled_under_a_pending_copy():
    """Steps prepared while the GPU is still busy (as with overlapped scheduling): each step's
    copies queue behind a long kernel, and its device tensors are cloned on the stream right
    after. Refilling a pinned buffer before its copy ran would give an earlier step the data of
    a later one."""
    sim = Simulation(12, num_groups=1)
    for _ in range(6):
        sim.add()
    buffers = InputBuffers(sim.batch, 8 * 64, BLOCK_SIZE, torch.device("cuda"))
    seen = []
    for _ in range(8):
        num_scheduled = sim.schedule()
        expected = reference_inputs(sim.batch, num_scheduled, BLOCK_SIZE, int(num_scheduled.sum()))
        torch.cuda._sleep(50_000_000)  # keeps the stream busy for tens of milliseconds
        step = buffers.prepare(num_scheduled, int(num_scheduled.sum()))
        seen.append((expected, step.input_ids.clone(), step.positions.clone(), step.slot_mappings[0].clone(),
                     step.seq_lens.clone()))
        sim.finish_step(num_scheduled, expected["complete_rows"])
    torch.cuda.synchronize()
    for expected, input_ids, positions, slots, seq_lens in seen:
        np.testing.assert_array_equal(to_numpy(input_ids), expected["input_ids"])
        np.testing.assert_array_equal(to_numpy(positions), expected["positions"])
        np.testing.assert_array_equal(to_numpy(slots), expected["slot_mappings"][0])
        np.testing.assert_array_equal(to_numpy(seq_lens), expected["seq_lens"])


@pytest.mark.cuda
def test_cuda_engine_tokens_equal_with_persistent_buffers(qwen3_dir):
    """The engine on a GPU, eager and with CUDA graphs (which read the persistent block table),
    synchronous and overlapped, chunked prefill and preemption forced: the CPU's greedy tokens
    (fp32, as test_cuda_engine's parity with HF)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 3000) for _ in range(n)] for n in (5, 40, 70, 3, 100, 17)]
    cpu_tokens, _, _ = run_checked(qwen3_dir, prompts, separate=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for enforce_eager, async_scheduling in ((True, False), (False, False), (False, True)):
        llm = LLM(qwen3_dir, multiprocess=False, device="cuda", dtype="float32", max_model_len=256,
                  max_num_batched_tokens=32, num_kv_blocks=12, block_size=16, enable_prefix_caching=False,
                  enforce_eager=enforce_eager, async_scheduling=async_scheduling)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.shutdown()
        assert [o.outputs[0].token_ids for o in outputs] == cpu_tokens, (enforce_eager, async_scheduling)
