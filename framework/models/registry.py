"""Placeholder: the model helper replaces this file."""
from sparrow.hookspecs import hookimpl


@hookimpl
def sparrow_register_model_architectures(register):
    pass
