"""A tool parser kept in a plain file rather than an installed plugin: `sparrow serve
--tool-parser-plugin tests/tool_parser_plugin.py --tool-call-parser hermes_from_file` (the server
of tests/test_tool_calling.py runs that way)."""

from sparrow.entrypoints.openai.tool_parsers import HermesToolParser
from sparrow.hookspecs import hookimpl

SPARROW_CONTRACT = ">=1.0,<2"


class FileHermesToolParser(HermesToolParser):
    """The hermes format, registered under a name of its own by this file."""


@hookimpl
def sparrow_register_tool_parsers(register):
    register("hermes_from_file", FileHermesToolParser)
