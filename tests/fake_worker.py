"""A worker for a throwaway test platform: the engine's far side, answering through the
``sparrow_execute_model`` hook of the test plugin that registers the platform."""

from __future__ import annotations

from tests.fake_executor import FakeExecutor


class FakeWorker:
    def __init__(self, config, platform, **_):
        self.platform = platform
        self.block_size = config.cache.block_size or 16
        self.fake = FakeExecutor(num_blocks=config.cache.num_kv_blocks or 64, block_size=self.block_size)

    def init_device(self):
        pass

    def load_model(self):
        pass

    def determine_num_kv_blocks(self):
        return self.fake.num_blocks

    def initialize_kv_cache(self, num_blocks):
        pass

    def execute_model(self, scheduler_output):
        return self.fake.execute_model(scheduler_output)

