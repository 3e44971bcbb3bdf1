"""Helpers under vLLM's import names (``from sparrow.utils import FlexibleArgumentParser``)."""

from sparrow.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
