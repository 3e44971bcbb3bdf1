"""The README quickstart, run the ways users run Python: as a script without a ``__main__`` guard,
with ``python -c``, piped to stdin, and with tensor parallelism; plus a guarded script with data
parallelism and a Ctrl-C in the middle of a generation.

Each runs as a real subprocess of a fresh interpreter with the built-in model (built once into this
session's ``SPARROW_CACHE_DIR``), because pytest imports code differently from a user's script:
a test that builds an ``LLM`` in pytest's own process could never see the main module re-imported.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparrow.engine.launch import start_process
from tests.test_cli import default_sigint

REPO_ROOT = Path(__file__).resolve().parents[1]
# A run that takes longer than this is hung (a child waiting on a parent that never answers).
_RUN_TIMEOUT_S = 600


def readme_quickstart() -> str:
    """The first Python block of README.md, exactly as printed there."""
    readme = (REPO_ROOT / "README.md").read_text()
    match = re.search(r"^```python\n(.*?)^```", readme, re.S | re.M)
    assert match, "README.md has no ```python block"
    return match.group(1)


def with_tensor_parallel(code: str) -> str:
    assert code.count("LLM()") == 1, "the README quickstart no longer builds `LLM()`; update this test"
    return code.replace("LLM()", "LLM(tensor_parallel_size=2)")


@pytest.fixture(scope="module")
def builtin_model() -> str:
    """Build the built-in model here, once, so no subprocess builds it (or races another)."""
    from sparrow.tiny.model import get_builtin_model_path

    return str(get_builtin_model_path())


def run_python(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    # cwd is a scratch directory: the child must import Sparrow from the environment, as a user's does.
    return subprocess.run([sys.executable, *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                          timeout=_RUN_TIMEOUT_S, env=dict(os.environ))


def assert_printed_text(result: subprocess.CompletedProcess) -> None:
    details = f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, details
    assert result.stdout.strip(), "no generated text was printed\n" + details
    assert "Traceback" not in result.stderr and "ERROR" not in result.stderr, details


# Each launch mode once, and tensor parallel in one of them: the children start the same way in
# every mode, and each run costs CI seconds. The plain file, the mode most at risk (spawned children
# must not run an unguarded main file again), runs in tests/test_docs_examples.py, once without and
# once with tensor parallelism (test_the_docs_run_the_unguarded_file_modes below keeps it so).
@pytest.mark.parametrize(("mode", "tensor_parallel"), [("dash_c", False), ("stdin", True)],
                         ids=["dash_c-tp1", "stdin-tp2"])
def test_readme_quickstart_runs_as_written(mode, tensor_parallel, builtin_model, tmp_path):
    code = readme_quickstart()
    if tensor_parallel:
        code = with_tensor_parallel(code)
    assert "__main__" not in code  # the point: a plain script, no guard
    if mode == "dash_c":
        result = run_python(["-c", code], tmp_path)
    else:
        result = run_python(["-"], tmp_path, stdin=code)
    assert_printed_text(result)


def test_the_docs_run_the_unguarded_file_modes():
    """The docs' examples run as files (python example.py): the README's quickstart as printed, and
    a tensor-parallel script, neither under a ``__main__`` guard."""
    from tests.test_docs_examples import ALL_EXAMPLES

    files = [e for e in ALL_EXAMPLES if e.language == "python" and e.mode == "run" and "__main__" not in e.code]
    assert any(e.path.name == "README.md" and e.code == readme_quickstart() for e in files)
    assert any(re.search(r"LLM\(.*tensor_parallel_size=2", e.code) for e in files)


def test_guarded_script_with_data_parallel(builtin_model, tmp_path):
    """Scripts written for multiprocessing's spawn (with the guard) keep working."""
    body = readme_quickstart().replace("LLM()", "LLM(data_parallel_size=2)")
    script = tmp_path / "guarded.py"
    script.write_text('if __name__ == "__main__":\n' + textwrap.indent(body, "    "))
    assert_printed_text(run_python([str(script)], tmp_path))


CTRL_C_SCRIPT = """
import os, signal, sys, threading, time
from sparrow import LLM, SamplingParams

llm = LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20)
print("core", llm.llm_engine.engine_core.proc.pid, flush=True)


def ctrl_c_while_running():
    while llm.llm_engine.get_num_unfinished_requests() == 0:
        time.sleep(0.01)
    time.sleep(0.3)
    os.killpg(os.getpgrp(), signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group


long = SamplingParams(max_tokens=1000, ignore_eos=True)
threading.Thread(target=ctrl_c_while_running, daemon=True).start()
try:
    llm.generate(["Once upon a time", "The sparrow"], long, use_tqdm=False)
    sys.exit("the generation ended before the interrupt")
except KeyboardInterrupt:
    print("interrupted", flush=True)
text = llm.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
print("after:", len(text) > 0, flush=True)
threading.Thread(target=ctrl_c_while_running, daemon=True).start()
llm.generate(["Once upon a time"], long, use_tqdm=False)  # interrupted, uncaught: the script ends here
"""


@pytest.mark.serial  # times a signal against a running generation
def test_ctrl_c_with_a_request_in_flight(builtin_model, tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(CTRL_C_SCRIPT)
    # A session of its own, so the script's Ctrl-C reaches its process group and not pytest's.
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_sigint)
    try:
        stdout, stderr = proc.communicate(timeout=_RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    details = f"exit code {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-4000:]}"
    lines = stdout.splitlines()
    assert "interrupted" in lines and "after: True" in lines, details
    # The uncaught interrupt ends the script as Python does (killed by SIGINT, or 130 with a handler).
    assert proc.returncode in (-signal.SIGINT, 130), details
    # The engine core was neither killed by the Ctrl-C nor reported dead: nothing logged as an error.
    assert "ERROR" not in stderr and "engine core is dead" not in stderr, details
    core_pid = int(next(line for line in lines if line.startswith("core ")).split()[1])
    deadline = time.monotonic() + 30
    while _is_running(core_pid):
        assert time.monotonic() < deadline, f"engine core {core_pid} outlived its interrupted script\n{details}"
        time.sleep(0.1)


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- the launcher itself (no model: fast) ---------------------------------------------------------
def report_surroundings(path: str, exit_code: int, death_pipe) -> None:
    """A child's target: write down what the child sees, then exit with ``exit_code``."""
    import __main__

    Path(path).write_text(json.dumps({
        "main_file": getattr(__main__, "__file__", None), "sys_path": sys.path, "cwd": os.getcwd(),
        "sid": os.getsid(0), "death_pipe_open": not death_pipe.poll(0),
    }))
    sys.exit(exit_code)


def test_a_child_sees_the_parents_path_and_none_of_its_main(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "only-in-the-parent"))
    report = tmp_path / "report.json"
    child = start_process(report_surroundings, name="Reporter", args=(str(report), 3))
    try:
        readable, _, _ = select.select([child.sentinel], [], [], 120)
        assert readable, "the sentinel did not report the child's exit"
        child.join(10)
        assert child.exitcode == 3 and not child.is_alive()
    finally:
        child.close()
    seen = json.loads(report.read_text())
    assert seen["sys_path"] == sys.path  # so anything the parent imports, the child can
    assert seen["cwd"] == os.getcwd()
    assert seen["main_file"] is None  # a bare `-c` main: pytest's was not imported again
    assert seen["sid"] != os.getsid(0)  # a session of its own: a terminal's Ctrl-C stays with us
    assert seen["death_pipe_open"]


def test_start_process_refuses_what_a_child_could_not_import():
    def local_target() -> None:
        pass

    local_target.__module__ = "__main__"
    with pytest.raises(ValueError, match="importable module"):
        start_process(local_target, name="Nope")
    with pytest.raises(TypeError, match="picklable"):  # fails in the caller, not in the child
        start_process(report_surroundings, name="Nope", args=(lambda: None,))


def test_readme_quickstart_in_a_jupyter_kernel(builtin_model, tmp_path):
    """A notebook cell: the kernel's ``__main__`` is no file at all, and the LLM outlives the cell."""
    jupyter_client = pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    manager = jupyter_client.KernelManager(kernel_name="python3")
    # The kernel runs this interpreter (the test's environment), in a scratch directory.
    manager.kernel_spec.argv[0] = sys.executable
    manager.start_kernel(cwd=str(tmp_path), env=dict(os.environ))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        printed: list[str] = []
        errors: list[str] = []

        def run_cell(code: str) -> None:
            def on_output(msg: dict) -> None:
                content = msg["content"]
                if msg["msg_type"] == "stream" and content["name"] == "stdout":
                    printed.append(content["text"])
                elif msg["msg_type"] == "error":
                    errors.append("\n".join(content["traceback"]))

            reply = client.execute_interactive(code, timeout=_RUN_TIMEOUT_S, output_hook=on_output)
            assert reply["content"]["status"] == "ok", "\n".join(errors)

        run_cell(readme_quickstart())
        assert "".join(printed).strip(), "the cell printed no generated text"
        # A second cell reuses the engine the first one built.
        printed.clear()
        run_cell("print(len(llm.generate('Hello', SamplingParams(max_tokens=4))[0].outputs[0].token_ids))")
        assert "".join(printed).strip() == "4"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
