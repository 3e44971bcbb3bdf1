"""The ``sparrow run-batch`` flags (vLLM's ``vllm run-batch``). Light, like ``cli_args``: the
runner (``sparrow.entrypoints.openai.run_batch``) is imported only when the command runs."""

from __future__ import annotations

import argparse
from typing import Any

from sparrow.entrypoints.openai.cli_args import _port, add_api_flags

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/score", "/v1/rerank",
              "/rerank", "/v2/rerank", "/classify", "/pooling")


def _run_batch(args: argparse.Namespace) -> int:
    from sparrow.entrypoints.openai.run_batch import run_batch_command

    return run_batch_command(args)


def add_run_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    from sparrow.entrypoints.cli import add_engine_args

    parser = subparsers.add_parser(
        "run-batch", help="run a file of OpenAI batch requests (JSONL) through a model, offline",
        description="Run every request of an OpenAI batch file (one JSON object per line: custom_id, method "
                    "POST, url, body) through the same handlers as `sparrow serve`, without a server, and write "
                    "one result line per request, in the input's order (see docs/serving.md). URLs: "
                    f"{', '.join(BATCH_URLS)}. A bad line fails alone, with an error result; the command exits "
                    "with 1 only when the input cannot be read, the output cannot be written or the engine dies.")
    parser.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                        help="local model directory (default: the built-in sparrow-tiny)")
    batch = parser.add_argument_group("batch")
    batch.add_argument("-i", "--input-file", required=True, metavar="PATH_OR_URL",
                       help="the batch: a local JSONL file, - for standard input, or an http(s) URL read with GET "
                            "(required)")
    batch.add_argument("-o", "--output-file", required=True, metavar="PATH_OR_URL",
                       help="where the results go: a local file (written as results complete, in order), - for "
                            "standard output, or an http(s) URL the whole file is uploaded to with PUT (required)")
    batch.add_argument("--output-tmp-dir", default=None, metavar="DIR",
                       help="with an output URL: the directory of the local copy made before the upload "
                            "(default: the system's temporary directory)")
    batch.add_argument("--enable-metrics", action="store_true",
                       help="serve the engine's Prometheus metrics at http://URL:PORT/metrics while the batch "
                            "runs (default: off)")
    batch.add_argument("--url", default="127.0.0.1", metavar="ADDRESS",
                       help="with --enable-metrics: the address the metrics server listens on; vLLM's default "
                            "is 0.0.0.0 (default: 127.0.0.1)")
    batch.add_argument("--port", type=_port, default=8000,
                       help="with --enable-metrics: the metrics server's port (default: 8000)")
    add_api_flags(parser.add_argument_group("API", "as sparrow serve"))
    add_engine_args(parser)
    parser.set_defaults(func=_run_batch)
    return parser
