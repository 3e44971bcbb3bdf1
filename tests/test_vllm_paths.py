"""vLLM V1's module paths under ``sparrow.v1``: code written against ``vllm.v1.*`` switches by
changing ``vllm`` to ``sparrow``, and gets Sparrow's own objects (not copies)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PATHS = [
    ("sparrow.v1.engine", "EngineCoreRequest", "sparrow.wire"),
    ("sparrow.v1.engine", "FinishReason", "sparrow.wire"),
    ("sparrow.v1.engine.async_llm", "AsyncLLM", "sparrow"),
    ("sparrow.v1.engine.llm_engine", "LLMEngine", "sparrow"),
    ("sparrow.v1.metrics.reader", "Counter", "sparrow.engine.metrics_reader"),
    ("sparrow.v1.metrics.reader", "Histogram", "sparrow.engine.metrics_reader"),
    ("sparrow.v1.sample.logits_processor", "LogitsProcessor", "sparrow.sample.logits_processor"),
    ("sparrow.v1.sample.logits_processor", "BatchUpdate", "sparrow.sample.logits_processor"),
    ("sparrow.v1.sample.logits_processor", "MoveDirectionality", "sparrow.sample.logits_processor"),
    ("sparrow.v1.executor.abstract", "Executor", "sparrow.executor.abstract"),
    ("sparrow.v1.core.sched.interface", "SchedulerInterface", "sparrow.core.sched.interface"),
    ("sparrow.v1.core.sched.output", "SchedulerOutput", "sparrow.core.sched.output"),
    ("sparrow.v1.core.sched.scheduler", "Scheduler", "sparrow.core.sched.scheduler"),
    ("sparrow.v1.outputs", "ModelRunnerOutput", "sparrow.worker.outputs"),
]


@pytest.mark.parametrize(("path", "name", "home"), PATHS)
def test_a_vllm_v1_path_gives_sparrows_object(path, name, home):
    assert getattr(importlib.import_module(path), name) is getattr(importlib.import_module(home), name)


def test_a_custom_logits_processor_written_for_vllm_imports_as_written(tmp_path):
    """vLLM's custom logits processor example starts with these imports; with ``vllm`` replaced
    by ``sparrow`` the class defines and subclasses Sparrow's interface."""
    script = tmp_path / "processor.py"
    script.write_text(
        "from sparrow.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality\n"
        "from sparrow.v1.metrics.reader import Counter, Gauge, Histogram, Vector\n"
        "class DummyLogitsProcessor(LogitsProcessor):\n"
        "    pass\n"
        "import sparrow.sample.logits_processor as home\n"
        "assert issubclass(DummyLogitsProcessor, home.LogitsProcessor)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
