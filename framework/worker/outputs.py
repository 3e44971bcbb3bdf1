"""What a worker returns after a step (crosses to the engine core).

The home of these messages is :mod:`sparrow.wire`; the names are re-exported here for the code
and the plugins that import them from this module.
"""

from __future__ import annotations

from sparrow.wire import ModelRunnerOutput, TokenLogprobs  # noqa: F401 - re-exported
