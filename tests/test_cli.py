"""The `sparrow` command as a user meets it: the real console script in a subprocess.

A mistake is one line (`sparrow: error: ...` naming what is wrong) and a non-zero status, never a
traceback; --help describes every flag with its default; --log-level reaches the engine's own
processes; `generate` streams; a reduced HF comparison is never printed as a speed-up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "sparrow"
# A small engine: these tests are about the command, not the cache.
SMALL = ["--max-model-len", "256", "--num-kv-blocks", "64"]


def default_sigint() -> None:
    """In a child before exec: Ctrl-C's default action. A shell starts background jobs with SIGINT
    ignored and a child inherits that, so a test run with `&` (or under nohup-like wrappers) would
    otherwise send Ctrl-C to processes that cannot hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sparrow_command() -> list[str]:
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "sparrow.entrypoints.cli"]


def run_sparrow(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {name: value for name, value in os.environ.items() if name != "SPARROW_LOGGING_LEVEL"}
    return subprocess.run([*sparrow_command(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, "SPARROW_CPU_THREADS": "1", **(env or {})}, cwd=cwd)


def assert_one_error_line(result: subprocess.CompletedProcess, *names: str) -> str:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sparrow: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# -- mistakes -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_weights_dir(qwen3_dir, tmp_path_factory) -> str:
    """A model directory whose weight file is missing (config and tokenizer are there)."""
    target = tmp_path_factory.mktemp("no-weights") / "model"
    shutil.copytree(qwen3_dir, target)
    for weights in target.glob("*.safetensors"):
        weights.unlink()
    return str(target)


MISTAKES = {
    # name: (extra arguments after `generate MODEL`, words the error line must contain)
    "unknown-scheduler": (["--scheduler", "fifo"], ["scheduler", "fifo"]),
    "negative-temperature": (["--temperature", "-1"], ["temperature"]),
    "unknown-device": (["--device", "nosuch"], ["device", "nosuch"]),
    "zero-max-num-seqs": (["--max-num-seqs", "0"], ["max_num_seqs"]),
    "empty-prompt": (["--prompt", ""], ["prompt"]),
    "unknown-logits-processor": (["--logits-processors", "nope"], ["logits_processors", "nope"]),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_is_one_line_naming_the_field(mistake, qwen3_dir):
    extra, names = MISTAKES[mistake]
    result = run_sparrow("generate", qwen3_dir, *SMALL, *extra)
    assert result.returncode == 2
    assert result.stdout == ""
    assert_one_error_line(result, *names)


def test_a_missing_weight_file_is_one_line(no_weights_dir):
    result = run_sparrow("generate", no_weights_dir, *SMALL)
    assert result.returncode == 2
    assert_one_error_line(result, "safetensors", no_weights_dir)


def test_a_missing_model_directory_is_one_line(tmp_path):
    missing = str(tmp_path / "no-such-model")
    result = run_sparrow("generate", missing, "--prompt", "Hi")
    assert result.returncode == 2
    assert_one_error_line(result, "model", missing)


def test_positional_and_flag_model_must_agree(qwen3_dir, no_weights_dir):
    result = run_sparrow("generate", qwen3_dir, "--model", no_weights_dir)
    assert_one_error_line(result, "model", "disagree")


def test_bad_benchmark_flags_are_one_line_before_anything_loads(qwen3_dir):
    result = run_sparrow("bench", "throughput", qwen3_dir, "--compare-hf", "--hf-num-prompts", "0")
    assert_one_error_line(result, "--hf-num-prompts")
    result = run_sparrow("bench", "throughput", qwen3_dir, "--engine-args", "{not json")
    assert_one_error_line(result, "--engine-args")


def test_a_busy_port_is_one_line_without_a_traceback(qwen3_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_sparrow("serve", qwen3_dir, "--port", str(port), *SMALL)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or str(port) in line]
    assert len(errors) == 1 and str(port) in errors[0], result.stderr


# Mistakes argparse finds (a wrong type, a value out of range, an unknown flag), in every command:
# one line naming the flag, no usage block. (arguments, words the error line must contain)
PARSER_MISTAKES = {
    "generate-int": (["generate", "--max-tokens", "abc"], ["--max-tokens", "abc", "sparrow generate --help"]),
    "generate-sampling-seed": (["generate", "--sampling-seed", "x"], ["--sampling-seed"]),
    "generate-json": (["generate", "--kv-connector-extra-config", "{bad json"], ["--kv-connector-extra-config"]),
    "generate-unknown-flag": (["generate", "--max-tokenz", "3"], ["--max-tokenz"]),
    "port-too-large": (["serve", "--port", "99999"], ["--port", "99999", "65535"]),
    "port-65536": (["serve", "--port", "65536"], ["--port", "65536"]),
    "port-negative": (["serve", "--port", "-1"], ["--port", "-1"]),
    "body-bytes-negative": (["serve", "--max-request-body-bytes", "-1"], ["--max-request-body-bytes"]),
    "body-bytes-zero": (["serve", "--max-request-body-bytes", "0"], ["--max-request-body-bytes"]),
    "empty-served-name": (["serve", "--served-model-name", ""], ["--served-model-name", "empty"]),
    "blank-scheduler": (["generate", "--scheduler", " "], ["--scheduler", "empty"]),
    "throughput-int": (["bench", "throughput", "--num-prompts", "many"], ["--num-prompts"]),
    "throughput-len-and-range": (["bench", "throughput", "--input-len", "8", "--input-len-min", "4"],
                                 ["--input-len", "--input-len-min"]),
    "throughput-len-zero": (["bench", "throughput", "--output-len", "0"], ["--output-len", "at least 1"]),
    "bench-serve-float": (["bench", "serve", "--request-rate", "fast"], ["--request-rate"]),
    "ablate-empty-value": (["bench", "ablate", "--schedulers", "fcfs,,sjf"], ["--schedulers", "fcfs,,sjf"]),
    "ablate-trailing-comma": (["bench", "ablate", "--block-size", "16,"], ["--block-size"]),
    "trace-int": (["bench", "trace", "--kind", "multi-turn", "--num-requests", "x", "-o", "t.jsonl"],
                  ["--num-requests"]),
    "sim-int": (["bench", "sim", "--num-prompts", "x"], ["--num-prompts"]),
    "plugins-unknown-flag": (["plugins", "--nope"], ["--nope"]),
    "unknown-command": (["genrate"], ["genrate"]),
}


@pytest.mark.parametrize("mistake", sorted(PARSER_MISTAKES))
def test_a_parser_mistake_is_one_line_without_the_usage(mistake, tmp_path):
    argv, names = PARSER_MISTAKES[mistake]
    result = run_sparrow(*argv, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "usage:" not in result.stderr
    assert_one_error_line(result, *names)


def test_help_still_prints_the_usage():
    result = run_sparrow("generate", "--help", timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: sparrow generate")


def test_port_zero_is_any_free_port_and_the_range_is_the_tcp_one():
    from sparrow.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--port", "0"]).port == 0
    assert build_parser().parse_args(["serve", "--port", "65535"]).port == 65535


def test_a_bad_logging_level_in_the_environment_is_refused_before_anything_runs(tmp_path):
    for flags in ([], ["--log-level", "INFO"]):  # a bad value is refused even where the flag wins
        result = run_sparrow(*flags, "generate", "--prompt", "Hi", env={"SPARROW_LOGGING_LEVEL": "bogus"},
                             timeout=120, cwd=tmp_path)
        assert result.returncode == 2 and result.stdout == ""
        assert_one_error_line(result, "SPARROW_LOGGING_LEVEL", "bogus")


def test_the_logging_level_from_the_environment_is_case_insensitive(monkeypatch):
    import argparse

    from sparrow.entrypoints.cli import configure_logging

    monkeypatch.setenv("SPARROW_LOGGING_LEVEL", "debug")
    assert configure_logging(argparse.Namespace(log_level=None, default_log_level="WARNING")) == "DEBUG"


def test_a_long_prompt_is_our_one_line_without_the_tokenizers_warning(qwen3_dir):
    from transformers import AutoTokenizer

    prompt = " ".join(["word"] * 3000)
    # The tokenizer would warn about this prompt (it is longer than its model_max_length).
    assert len(AutoTokenizer.from_pretrained(qwen3_dir).encode(prompt, verbose=False)) > \
        AutoTokenizer.from_pretrained(qwen3_dir).model_max_length
    result = run_sparrow("generate", qwen3_dir, *SMALL, "--prompt", prompt)
    assert result.returncode == 2
    assert "Token indices sequence length" not in result.stderr
    assert_one_error_line(result, "prompt", "max_model_len")


@pytest.mark.parametrize("adapter", ["missing", "not-an-adapter"])
def test_a_lora_start_up_failure_is_quiet_but_for_its_one_line(qwen3_dir, tmp_path, adapter):
    """The engine core is stopped just after it reported ready: its I/O threads must stop before
    its sockets close, not log a ZMQError traceback (once 3 in 3 runs)."""
    path = tmp_path / "no-such-adapter" if adapter == "missing" else tmp_path  # a directory, but no adapter
    result = run_sparrow("serve", qwen3_dir, *SMALL, "--port", "0", "--enable-lora", "--lora-modules",
                         f"foo={path}", env={"SPARROW_LOGGING_LEVEL": "WARNING"})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "ERROR" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--lora-modules" in lines[0] and str(path) in lines[0], result.stderr


# -- benchmark outputs ------------------------------------------------------------------------
# Every benchmark that writes a report, with the flag naming it.
BENCH_OUTPUTS = [
    (["bench", "throughput"], "--result-file"),
    (["bench", "latency"], "--result-file"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:9"], "--result-file"),
    (["bench", "sim"], "--result-file"),
    (["bench", "ablate"], "--output-dir"),
    (["bench", "trace", "--kind", "multi-turn"], "--output"),
]


@pytest.mark.parametrize(("command", "flag"), BENCH_OUTPUTS, ids=lambda value: " ".join(value)
                         if isinstance(value, list) else value)
def test_an_unwritable_report_fails_before_the_benchmark_runs(command, flag, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    elsewhere = tmp_path / "elsewhere" / "dir" / "report"  # outside the working directory
    for path in ("/proc/sparrow-report", str(elsewhere)):
        result = run_sparrow(*command, flag, path, timeout=120, cwd=work)
        assert result.returncode == 2 and result.stdout == "", result.stdout  # nothing ran
        assert_one_error_line(result, flag, path)
    assert not (tmp_path / "elsewhere").exists()  # never created


def test_report_paths_follow_one_rule(tmp_path, monkeypatch):
    from sparrow.bench.outputs import check_output_path

    monkeypatch.chdir(tmp_path)
    check_output_path("--result-file", "bench-results/new/x.json", is_dir=False)  # created later, inside
    check_output_path("--output-dir", str(tmp_path.parent / "new-dir"), is_dir=True)  # its parent exists
    assert not (tmp_path / "bench-results").exists() and not (tmp_path.parent / "new-dir").exists()
    (tmp_path / "a-file").write_text("")
    for path, is_dir, words in [
        (str(tmp_path.parent / "missing" / "x.json"), False, "does not exist"),
        (str(tmp_path.parent / "missing" / "out"), True, "does not exist"),
        ("a-file", True, "not a directory"),
        ("a-file/x.json", False, "not a directory"),
        (".", False, "is a directory"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_output_path("--flag", path, is_dir=is_dir)


def test_every_bench_output_flag_is_checked_and_documented():
    import argparse

    from sparrow.bench.outputs import OUTPUTS, RULE
    from sparrow.entrypoints.cli import build_parser

    bench = _subparser(build_parser(), "bench")
    action = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    seen = set()
    for name, parser in action.choices.items():
        for option in parser._actions:
            if any(flag in ("--result-file", "--output-dir", "--output") for flag in option.option_strings):
                assert option.dest in OUTPUTS, (name, option.dest)
                assert RULE in option.help, (name, option.option_strings)
                seen.add(name)
    assert seen == {"throughput", "latency", "serve", "sim", "ablate", "trace"}


def test_debug_shows_the_traceback(qwen3_dir):
    result = run_sparrow("generate", qwen3_dir, "--temperature", "-1", "--debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("sparrow: error: ")


# -- help and version ---------------------------------------------------------------------------
HELP_COMMANDS = [["generate"], ["serve"], ["bench", "throughput"], ["bench", "latency"], ["bench", "serve"],
                 ["bench", "ablate"]]


def _subparser(parser, *names):
    import argparse

    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=" ".join)
def test_every_flag_has_a_real_help_text(command):
    import argparse

    from sparrow.entrypoints.cli import build_parser

    parser = _subparser(build_parser(), *command)
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.help == argparse.SUPPRESS:
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and len(action.help.split()) >= 2, f"{' '.join(command)} {name} has no help text"
        assert not re.search(r"\b\w+ setting\b", action.help), f"{name}: placeholder help {action.help!r}"


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "throughput"]], ids=" ".join)
def test_help_shows_defaults_and_hides_internal_flags(command):
    result = run_sparrow(*command, "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert not re.search(r"\b(cache|scheduler|model|parallel|device) setting\b", text)
    assert "--data-parallel-rank" not in text
    if command == ["bench", "throughput"]:
        assert "--num-prompts NUM_PROMPTS requests in the workload (default: 64)" in text
        assert "(default: one batch of all; 32 with --preset gpu)" in text
    else:
        assert "Most requests running in one step (default: 256)." in text
        assert "(default: the platform's, CPU 2048, CUDA 8192)" in text
        assert "--scheduler SCHEDULER" in text and "(default: fcfs)" in text


def test_internal_flags_are_still_accepted():
    from sparrow.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--data-parallel-rank", "1", "--max-num-seqs", "8"])
    assert engine_kwargs(args) == {"data_parallel_rank": 1, "max_num_seqs": 8}
    args = build_parser().parse_args(["serve", "--data-parallel-rank", "1"])
    assert args.data_parallel_rank == 1


def test_help_texts_name_real_files_and_say_what_seed_does():
    from sparrow.entrypoints.cli import _sub_parsers, build_parser

    for parser in _sub_parsers(build_parser()):
        assert "BENCHMARKS.md" not in parser.format_help(), parser.prog  # the file is docs/benchmarks.md
    seed = next(a for a in _subparser(build_parser(), "generate")._actions if "--seed" in a.option_strings)
    assert "built-in weights" not in seed.help  # the built-in model is always built with seed 0


def test_version():
    from sparrow import __version__

    result = run_sparrow("--version", timeout=120)
    assert result.returncode == 0
    assert result.stdout.strip() == f"sparrow {__version__}"


# Every command builds the whole parser; `serve` and `plugins` load the server stack and torch
# only when they run.
LIGHT_COMMAND = """
import sys
from sparrow.entrypoints.cli import build_parser, cmd_plugins
from sparrow.entrypoints.openai.cli_args import _run_server
args = build_parser().parse_args(sys.argv[1:])
assert args.func is _run_server, args.func
heavy = ("fastapi", "uvicorn", "torch", "sparrow.entrypoints.openai.api_server", "sparrow.engine.async_llm")
print("parser:", [name for name in heavy if name in sys.modules])
cmd_plugins(build_parser().parse_args(["plugins"]))
print("plugins:", [name for name in heavy if name in sys.modules])
"""


def test_the_parser_and_plugins_import_no_server_stack_nor_torch():
    result = subprocess.run([sys.executable, "-c", LIGHT_COMMAND, "serve", "--port", "1"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "parser: []" in result.stdout and "plugins: []" in result.stdout, result.stdout
    assert "cpu" in result.stdout and "linear" in result.stdout  # the listing and its op table ran
    proposers = next(line for line in result.stdout.splitlines() if line.startswith("speculative proposers"))
    assert all(name in proposers for name in ("ngram", "draft_model", "eagle")), proposers


def test_serve_flag_constants_match_the_server():
    from sparrow.entrypoints.openai import cli_args, lifecycle, serving_models

    assert cli_args.DEFAULT_SHUTDOWN_TIMEOUT_S == lifecycle.DEFAULT_SHUTDOWN_TIMEOUT_S
    assert cli_args.ENV_RUNTIME_LORA == serving_models.ENV_RUNTIME_LORA
    from sparrow.worker.profiler import PROFILER_DIR_ENV

    assert cli_args.ENV_PROFILER_DIR == PROFILER_DIR_ENV
    from sparrow.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--lora-modules", "sql=/adapters/sql", "--shutdown-timeout", "2.5"])
    assert args.lora_modules == [{"name": "sql", "path": "/adapters/sql"}] and args.shutdown_timeout == 2.5


# -- generate -----------------------------------------------------------------------------------
# Each `generate` is a fresh interpreter, a model load and an engine-core process: most of this
# file's time. Three runs serve the three tests below (and the logging test further down); each
# run varies one more thing, so every comparison still has a run without that thing.
GENERATE = ["--max-tokens", "8", *SMALL]


@pytest.fixture(scope="module")
def generate_runs(qwen3_dir, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    # The same flags as a vLLM user may write them: in a --config file (with the model) and
    # spelled with underscores.
    config = tmp_path_factory.mktemp("generate-config") / "engine.yaml"
    config.write_text(f"model: {qwen3_dir}\nmax_tokens: 8\n")
    underscored = ["--" + arg[2:].replace("-", "_") if arg.startswith("--") else arg for arg in SMALL]
    return {
        # MODEL positional, one prompt, the default (quiet) log level.
        "positional": run_sparrow("generate", qwen3_dir, "--prompt", "The sky", *GENERATE),
        # The same request with --model (from a --config file) and underscored flags, and
        # --log-level INFO (logs go to stderr, never stdout).
        "flag": run_sparrow("--log-level", "INFO", "generate", "--config", str(config), "--prompt", "The sky",
                            *underscored),
        # Two prompts in one batch, INFO from the environment variable the processes read.
        "several": run_sparrow("generate", qwen3_dir, "--prompt", "Hello", "--prompt", "The sky", *GENERATE,
                               env={"SPARROW_LOGGING_LEVEL": "INFO"}),
    }


def test_generate_model_flag_equals_the_positional(generate_runs):
    positional, flag = generate_runs["positional"], generate_runs["flag"]
    assert positional.returncode == 0 and flag.returncode == 0, positional.stderr + flag.stderr
    assert positional.stdout.startswith("The sky") and len(positional.stdout.strip()) > len("The sky")
    assert flag.stdout == positional.stdout


def test_generate_several_prompts_prints_each_with_its_continuation(generate_runs):
    result, single = generate_runs["several"], generate_runs["positional"]
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("--- ")]
    assert sorted(headers) == ["--- 'Hello'", "--- 'The sky'"]
    assert single.returncode == 0, single.stderr
    assert single.stdout.strip() in result.stdout  # greedy: the same text alone or in a batch


@pytest.mark.serial  # times a signal against a running generation
def test_generate_streams_and_stops_cleanly_on_ctrl_c(qwen3_dir):
    """Text arrives while the request still runs; Ctrl-C then ends it with one line, no ERROR."""
    base = {name: value for name, value in os.environ.items() if name != "SPARROW_LOGGING_LEVEL"}
    proc = subprocess.Popen(
        [*sparrow_command(), "generate", qwen3_dir, "--prompt", "Hello", "--max-tokens", "2000", "--ignore-eos",
         "--max-model-len", "2048", "--kv-cache-memory-bytes", str(16 << 20)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**base, "SPARROW_CPU_THREADS": "1"},
        start_new_session=True,
        preexec_fn=default_sigint)
    try:
        first = proc.stdout.read(len("Hello") + 8)  # the prompt and the first generated bytes
        assert first.startswith(b"Hello") and len(first) > len("Hello")
        # 2000 tokens take seconds: still generating, so the text above was streamed.
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert stderr.decode().strip() == "sparrow: interrupted"


# -- logging ------------------------------------------------------------------------------------
def test_log_level_governs_the_engine_processes(generate_runs):
    verbose = generate_runs["flag"]  # --log-level INFO
    assert verbose.returncode == 0, verbose.stderr
    # The engine core is another process: its INFO lines carry its own tag.
    assert re.search(r"^INFO .*\[EngineCore", verbose.stderr, re.MULTILINE), verbose.stderr
    # The default is quiet (an explicit quieter level goes through the same path as INFO above).
    quiet = generate_runs["positional"]
    assert quiet.returncode == 0, quiet.stderr
    assert not re.search(r"^INFO", quiet.stderr, re.MULTILINE), quiet.stderr
    assert quiet.stdout.startswith("The sky")
    # The environment variable the processes read works on its own too.
    from_env = generate_runs["several"]
    assert from_env.returncode == 0, from_env.stderr
    assert "[EngineCore" in from_env.stderr


# -- honest comparisons -------------------------------------------------------------------------
def test_a_reduced_hf_run_is_never_a_speed_up(qwen3_dir, tmp_path):
    result_file = tmp_path / "throughput.json"
    result = run_sparrow("bench", "throughput", qwen3_dir, "--num-prompts", "3", "--input-len-min", "4",
                         "--input-len-max", "12", "--output-len-min", "2", "--output-len-max", "5",
                         "--compare-hf", "--hf-num-prompts", "1", "--result-file", str(result_file),
                         "--engine-args", json.dumps({"num_kv_blocks": 64, "max_model_len": 256}))
    assert result.returncode == 0, result.stderr
    assert "HF per-batch output tok/s" in result.stdout
    assert "first 1 of 3 prompts" in result.stdout
    assert not re.search(r"speed-?up|\d\s*x\b|x HF", result.stdout, re.IGNORECASE), result.stdout
    report = json.loads(result_file.read_text())
    assert report["hf_num_prompts"] == 1 and report["hf_same_workload"] is False
    assert "speedup_vs_hf" not in report
    assert "HF generate" in result.stderr  # its progress bar


def test_throughput_takes_vllms_fixed_lengths_and_prints_its_line(qwen3_dir, tmp_path):
    result_file = tmp_path / "throughput.json"
    result = run_sparrow("bench", "throughput", qwen3_dir, "--num-prompts", "3", "--input-len", "9",
                         "--output-len", "4", "--result-file", str(result_file),
                         "--engine-args", json.dumps({"num_kv_blocks": 64, "max_model_len": 256}))
    assert result.returncode == 0, result.stderr
    report = json.loads(result_file.read_text())
    assert (report["prompt_tokens"], report["output_tokens"]) == (3 * 9, 3 * 4)
    line = next(line for line in result.stdout.splitlines() if line.startswith("Throughput: "))
    numbers = [float(value) for value in re.findall(r"[\d.]+", line)]
    assert numbers == pytest.approx([3 / report["engine_elapsed_s"], report["engine_total_tok_s"],
                                     report["engine_output_tok_s"]], rel=1e-2)
