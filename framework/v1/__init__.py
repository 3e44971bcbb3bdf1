"""vLLM V1's module paths, for code that imports from them: ``from vllm.v1.engine.async_llm import
AsyncLLM`` becomes ``from sparrow.v1.engine.async_llm import AsyncLLM`` by changing ``vllm`` to
``sparrow``. Each module re-exports Sparrow's object under vLLM's name:

    sparrow.v1.engine                    EngineCoreRequest, EngineCoreOutput(s), FinishReason
    sparrow.v1.engine.async_llm          AsyncLLM
    sparrow.v1.engine.llm_engine         LLMEngine
    sparrow.v1.metrics.reader            Metric, Counter, Gauge, Vector, Histogram
    sparrow.v1.sample.logits_processor   LogitsProcessor, BatchUpdate, MoveDirectionality, ...
    sparrow.v1.executor.abstract         Executor
    sparrow.v1.core.sched.interface      SchedulerInterface
    sparrow.v1.core.sched.output         SchedulerOutput
    sparrow.v1.core.sched.scheduler      Scheduler
    sparrow.v1.outputs                   ModelRunnerOutput
"""
