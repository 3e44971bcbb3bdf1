"""Executors run the workers: in the engine-core process (uni) or one process per rank (mp)."""

from __future__ import annotations

from sparrow.executor.abstract import Executor, KVCacheInfo, make_executor

__all__ = ["Executor", "KVCacheInfo", "make_executor"]
