"""A fake executor: the far side of the engine core in kernel tests.

It behaves like a worker that tracks every request's tokens and block table from the scheduler
output alone, checks that the blocks cover the tokens, and "samples" a deterministic function of
the sequence so far, so the same request produces the same tokens however it is scheduled.
"""

from __future__ import annotations

from sparrow.core.sched.output import SchedulerOutput
from sparrow.executor import Executor, KVCacheInfo
from sparrow.worker.outputs import ModelRunnerOutput


def next_token(token_ids: list[int], vocab_size: int) -> int:
    return (sum(token_ids) * 31 + len(token_ids) * 7) % vocab_size


class FakeExecutor(Executor):
    def __init__(self, num_blocks: int = 64, block_size: int = 16, vocab_size: int = 1000) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.tokens: dict[str, list[int]] = {}  # req_id -> all token ids the worker knows
        self.computed: dict[str, int] = {}  # req_id -> num_computed_tokens
        self.block_ids: dict[str, list[int]] = {}  # req_id -> block table
        self.history: list[SchedulerOutput] = []

    def initialize(self) -> KVCacheInfo:
        return KVCacheInfo(self.num_blocks, self.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.history.append(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            for table in (self.tokens, self.computed, self.block_ids):
                table.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.block_ids[new.req_id] = list(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            if self.computed[req_id] != num_computed:
                raise AssertionError(
                    f"{req_id}: worker has {self.computed[req_id]} computed, scheduler says {num_computed}")
            self.block_ids[req_id].extend(new_blocks)
        req_ids, sampled = [], []
        for req_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            self.computed[req_id] += num_new_tokens
            if len(self.block_ids[req_id]) * self.block_size < self.computed[req_id]:
                raise AssertionError(f"{req_id}: blocks do not cover {self.computed[req_id]} tokens")
            if len(set(self.block_ids[req_id])) != len(self.block_ids[req_id]):
                raise AssertionError(f"{req_id}: a block appears twice in its table")
            req_ids.append(req_id)
            if self.computed[req_id] >= len(tokens):
                token = next_token(tokens, self.vocab_size)
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self, method)(*args, **(kwargs or {}))]
