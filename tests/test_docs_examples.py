"""Every Python and shell example in README.md and docs/ runs as written.

A quickstart once crashed for users saved to a file while every other test passed; this test
makes the documentation part of the suite. Each fenced ```python or ```bash block is one test:

- a Python block is written to a file and run with ``python file.py`` in a fresh directory;
- a bash block is run with ``bash -e`` with the virtual environment's ``bin`` first on PATH.

A line ``<!-- doc-test: MODE (reason) -->`` directly above a fence changes that:

- ``skip (reason)``: not run (it needs a GPU, a second machine, a model of your own, or minutes
  of benchmarking). Every ``sparrow ...`` command in it is still parsed by the real CLI parser,
  so a renamed or removed flag fails here.
- ``fragment (reason)``: a piece of a larger program (a plugin's hook implementation); it is
  compiled, not run.
- ``server``: needs ``sparrow serve`` running; the test starts one with the built-in model on a
  free port and points the example's ``127.0.0.1:8000`` at it.

Placeholders for the user's own model (``/models/NAME`` and ``/path/to/...``) are replaced by a
small local test model, so the examples that load one still run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*doc-test:\s*(skip|fragment|server)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
PLACEHOLDER_MODEL = re.compile(r"(/models/[\w.-]+|/path/to/[\w./-]*[\w-])")
DEFAULT_URL = "127.0.0.1:8000"
RUN_TIMEOUT_S = 420


@dataclass(frozen=True)
class Example:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    mode: str  # "run", "skip", "fragment" or "server"
    reason: str

    @property
    def test_id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract_examples(path: Path) -> list[Example]:
    examples: list[Example] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        language = fence.group(1)
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if language in ("python", "bash"):
            marker = MARKER.search(lines[index - 1]) if index > 0 else None
            mode, reason = (marker.group(1), marker.group(2).strip("() ")) if marker else ("run", "")
            examples.append(Example(path, index + 1, language, "\n".join(lines[index + 1:end]) + "\n",
                                    mode, reason))
        index = end + 1
    return examples


ALL_EXAMPLES = [example for path in DOC_FILES for example in extract_examples(path)]


def sparrow_commands(script: str) -> list[list[str]]:
    """The argument lists of the ``sparrow`` commands in a shell snippet (continuations joined,
    comments, ``VAR=value`` prefixes and a trailing ``&`` dropped)."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]
        if words and words[-1] == "&":
            words = words[:-1]
        if words and words[0] == "sparrow":
            commands.append(words[1:])
    return commands


def test_the_docs_have_examples_and_every_skip_says_why():
    assert len(ALL_EXAMPLES) >= 10, "the extractor found too few examples; did the fence format change?"
    readme_python = [e for e in ALL_EXAMPLES if e.path.name == "README.md" and e.language == "python"]
    assert readme_python and readme_python[0].mode == "run", "the README's quickstart must run as written"
    for example in ALL_EXAMPLES:
        if example.mode in ("skip", "fragment"):
            assert example.reason, f"{example.test_id}: a {example.mode} marker must say why"


@pytest.mark.parametrize("example", [e for e in ALL_EXAMPLES if e.language == "bash"],
                         ids=lambda e: e.test_id)
def test_every_documented_sparrow_command_parses(example):
    """Flags in the docs exist: each ``sparrow ...`` line parses with the real CLI parser."""
    from sparrow.entrypoints.cli import build_parser

    parser = build_parser()
    for argv in sparrow_commands(example.code):
        # `--config FILE` reads a file the block itself writes; the block's run covers it.
        argv = [arg for index, arg in enumerate(argv) if "--config" not in (arg, argv[index - 1] if index else "")
                and not arg.startswith("--config=")]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{example.test_id}: `sparrow {shlex.join(argv)}` does not parse (exit {exc.code})")


@pytest.fixture(scope="module")
def docs_model_dir(tmp_path_factory) -> str:
    from tests.conftest import build_test_model

    return build_test_model(tmp_path_factory.mktemp("docs-model"), "qwen3", seed=7)


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    from tests.test_server import free_port

    port = free_port()
    log_path = tmp_path_factory.mktemp("docs-server") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "sparrow"), "serve", "--port", str(port),
             "--kv-cache-memory-bytes", str(64 << 20)],
            stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        _wait_healthy(proc, port, log_path)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, port: int, log_path: Path) -> None:
    import time

    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sparrow serve exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"sparrow serve was not healthy in time:\n{log_path.read_text()}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.parametrize("example", ALL_EXAMPLES, ids=lambda e: e.test_id)
def test_example_runs_as_written(example, tmp_path, request):
    if example.mode == "skip":
        pytest.skip(f"{example.test_id}: {example.reason}")
    if example.mode == "fragment":
        if example.language == "python":
            compile(example.code, example.test_id, "exec")
        return
    code = example.code
    if PLACEHOLDER_MODEL.search(code):
        code = PLACEHOLDER_MODEL.sub(request.getfixturevalue("docs_model_dir"), code)
    if example.mode == "server":
        port = request.getfixturevalue("docs_server")
        code = code.replace(DEFAULT_URL, f"127.0.0.1:{port}")
    if example.language == "python":
        script = tmp_path / "example.py"
        script.write_text(code, encoding="utf-8")
        command = [sys.executable, str(script)]
    else:
        script = tmp_path / "example.sh"
        script.write_text(code, encoding="utf-8")
        command = ["bash", "-e", str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (
        f"{example.test_id} failed (exit {result.returncode})\n--- code\n{code}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
    assert result.stdout.strip(), f"{example.test_id} printed nothing"
