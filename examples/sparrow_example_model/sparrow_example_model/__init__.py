"""An out-of-tree Sparrow model architecture: ``GraniteForCausalLM``.

The entry point names this module, so it is imported in every process that loads plugins: it
only registers the architecture by import path; the model code (``model.py``, which imports
torch) is imported by the worker when a checkpoint of this architecture is loaded.
"""

from __future__ import annotations

from sparrow.hookspecs import hookimpl

# The hook-contract versions (sparrow.hookspecs.CONTRACT_VERSION) this plugin was written for.
SPARROW_CONTRACT = ">=1.0,<2"


@hookimpl
def sparrow_register_model_architectures(register):
    register("GraniteForCausalLM", "sparrow_example_model.model:GraniteForCausalLM")
