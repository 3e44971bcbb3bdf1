"""Structured outputs (constrained decoding) with xgrammar.

``grammar``: StructuredOutputsParams -> xgrammar Grammar (frontend checks and engine-core compiles);
``manager``: the engine core's compile pool, cache, per-request matchers and the step's bitmask.

Nothing here is imported by ``sparrow.core`` (xgrammar imports torch): the scheduler sees a
request's matcher only through the duck-typed methods of :class:`manager.StructuredOutputRequest`.
"""
