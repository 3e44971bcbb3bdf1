"""A reasoning parser kept in a plain file rather than an installed plugin: `sparrow serve
--reasoning-parser-plugin tests/reasoning_parser_plugin.py --reasoning-parser qwen3_from_file`
(the reasoning server of tests/test_reasoning.py runs that way)."""

from sparrow.hookspecs import hookimpl
from sparrow.reasoning import Qwen3ReasoningParser

SPARROW_CONTRACT = ">=1.0,<2"


class FileQwen3ReasoningParser(Qwen3ReasoningParser):
    """Qwen3's <think> format, registered under a name of its own by this file."""


@hookimpl
def sparrow_register_reasoning_parsers(register):
    register("qwen3_from_file", FileQwen3ReasoningParser)
