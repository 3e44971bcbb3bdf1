"""The conformance suite as a vendor meets it: ``sparrow plugins --check DEVICE`` on the built-in
cpu platform and on the out-of-tree example platform (both pass), on a copy of the example whose
RMSNorm is perturbed (fails, naming the op and the case), and as a pytest plugin.

The CLI and pytest runs are subprocesses (entry points are read once per process). The perturbed
copy is never pip-installed: it is a package plus a ``*.dist-info`` directory on the child's
``PYTHONPATH``, so nothing of it can outlive the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sparrow.conformance import Check, all_checks, run_check, select_checks
from sparrow.conformance.attention import attention_check
from sparrow.conformance.engine import compare_with_hf
from sparrow.conformance.report import GROUP_WIDTH, NAME_WIDTH, RESULT_WIDTH, CheckResult, Report
from sparrow.ops import KERNEL_OPS
from sparrow_cpu.attention import TorchPagedAttention
from tests.test_out_of_tree_plugins import EXAMPLES, pip_installed

CHECK_TIMEOUT_S = 600
PERTURBATION = 1e-2


def child_env(extra_path: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SPARROW_PLUGINS", "SPARROW_TRACE_FILE")}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH")) if p)
    return env


def sparrow_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("sparrow")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sparrow.entrypoints.cli"]
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)


def parse_table(stdout: str) -> dict[str, tuple[str, str]]:
    """check id -> (result, detail) from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        group = line[:GROUP_WIDTH].strip()
        if group not in ("ops", "attention", "engine"):
            continue
        name_end = GROUP_WIDTH + 1 + NAME_WIDTH
        name = line[GROUP_WIDTH + 1: name_end].strip()
        result = line[name_end + 1: name_end + 1 + RESULT_WIDTH].strip()
        rows[f"{group}/{name}"] = (result, line[name_end + 2 + RESULT_WIDTH:])
    return rows


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> str:
    # The engine checks' tiny models, built by the first run and reused by the next.
    return str(tmp_path_factory.mktemp("conformance-models"))


def perturbed_copy(root: Path) -> Path:
    """The example platform renamed (package sparrow_broken_platform, platform and entry point
    cpu_broken) with its RMSNorm off by PERTURBATION; returns the directory for PYTHONPATH."""
    site = root / "site"
    package = site / "sparrow_broken_platform"
    shutil.copytree(EXAMPLES / "sparrow_example_platform" / "sparrow_example_platform", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for source in package.glob("*.py"):
        text = source.read_text().replace("sparrow_example_platform", "sparrow_broken_platform")
        source.write_text(text.replace('"cpu_sdpa"', '"cpu_broken"'))
    with (package / "ops.py").open("a") as ops:
        ops.write(f"""

_exact_call = TorchRMSNorm.__call__


def _perturbed_call(self, x, residual=None):
    out = _exact_call(self, x, residual)
    if isinstance(out, tuple):
        return out[0] + {PERTURBATION}, out[1]
    return out + {PERTURBATION}


TorchRMSNorm.__call__ = _perturbed_call
""")
    dist_info = site / "sparrow_broken_platform-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: sparrow-broken-platform\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text("[sparrow]\ncpu_broken = sparrow_broken_platform\n")
    return site


# -- the CLI ------------------------------------------------------------------------------------
def test_builtin_cpu_platform_passes_the_op_and_attention_checks(model_cache):
    # The engine group runs in full on the example platform below (and the cpu engine's tokens are
    # compared with HF by test_parity.py and others); here the cpu plugin's own kernels are checked,
    # which keeps the suite's time in CI's budget.
    proc = sparrow_cli("plugins", "--check", "cpu", "--only", "ops,attention", "--model-dir", model_cache,
                       env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = parse_table(proc.stdout)
    expected = {check.check_id for check in all_checks() if check.check_id.split("/")[0] in ("ops", "attention")}
    assert set(rows) == expected, proc.stdout
    assert all(result in ("pass", "native") for result, _ in rows.values()), proc.stdout
    # The cpu plugin's kernels are what was checked, not the reference.
    assert rows["ops/linear"][0] == "pass" and "OneDnnLinear" in rows["ops/linear"][1]
    assert "TorchPagedAttention" in rows["attention/paged[gqa, d64]"][1]
    summary = proc.stdout.rstrip().splitlines()[-1]
    assert summary.startswith(f"{len(expected)} checks: ") and "failed" not in summary, proc.stdout


@pytest.mark.serial  # pip-installs a plugin into the environment
def test_example_platform_replaces_rms_norm_and_passes(model_cache, tmp_path):
    with pip_installed("sparrow_example_platform", "sparrow-example-platform", tmp_path):
        listing = sparrow_cli("plugins", env=child_env())
        proc = sparrow_cli("plugins", "--check", "cpu_sdpa", "--model-dir", model_cache, env=child_env())
    assert listing.returncode == 0, listing.stderr
    # `sparrow plugins`: one column per platform; the example's RMSNorm in its column only.
    ops_section = listing.stdout.split("ops (native = the torch reference):\n", 1)[1].splitlines()
    header = ops_section[0].split()
    assert header[0] == "op" and {"cpu", "cpu_sdpa"} <= set(header[1:])
    num_ops = len(KERNEL_OPS)
    table = {line.split()[0]: dict(zip(header[1:], line.split()[1:])) for line in ops_section[1:num_ops + 1]}
    assert table["rms_norm"]["cpu_sdpa"] == "sparrow_example_platform.ops:TorchRMSNorm"
    assert table["silu_and_mul"]["cpu_sdpa"] == "native"
    assert "sparrow_cpu" in table["rms_norm"]["cpu"]
    assert ops_section[num_ops + 1].split() == ["attention", "via", "sparrow_attention_backend"]

    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = parse_table(proc.stdout)
    assert rows["ops/rms_norm"][0] == "pass"
    assert rows["ops/rms_norm"][1].startswith("sparrow_example_platform.ops:TorchRMSNorm: "), rows["ops/rms_norm"]
    assert rows["ops/linear"][0] == "native"
    assert "GatherSdpaAttention" in rows["attention/paged[mha, d128]"][1]
    assert "block size 32" in rows["attention/paged[mha, d128]"][1]  # the platform's own default
    assert all(result in ("pass", "native") for result, _ in rows.values()), proc.stdout
    assert len(rows) == len(all_checks())


def test_perturbed_op_fails_with_a_table_naming_the_op_and_case(tmp_path):
    site = perturbed_copy(tmp_path)
    proc = sparrow_cli("plugins", "--check", "cpu_broken", "--only", "ops", env=child_env(site))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = parse_table(proc.stdout)
    assert set(rows) == {f"ops/{check.name}" for check in select_checks("ops")}
    result, detail = rows["ops/rms_norm"]
    assert result == "FAIL"
    assert "sparrow_broken_platform.ops:TorchRMSNorm: case '1x64': max abs err 0.01" in detail, detail
    assert "more failing cases" in detail
    assert all(rows[check_id][0] == "native" for check_id in rows if check_id != "ops/rms_norm")
    assert "FAILED ops/rms_norm: " in proc.stdout
    num_ops = len(select_checks("ops"))
    assert f"{num_ops} checks: {num_ops - 1} native, 1 failed" in proc.stdout


def test_check_flags_are_validated_before_anything_runs():
    env = child_env()
    unknown = sparrow_cli("plugins", "--check", "cpu", "--only", "ops/nope", env=env)
    assert unknown.returncode == 2 and "only: 'ops/nope' matches no check" in unknown.stderr
    assert unknown.stdout == ""
    device = sparrow_cli("plugins", "--check", "nodev", env=env)
    assert device.returncode == 2 and "unknown device 'nodev'" in device.stderr
    dtype = sparrow_cli("plugins", "--check", "cpu", "--dtype", "float16", env=env)
    assert dtype.returncode == 2 and "dtype 'float16' is not supported on platform 'cpu'" in dtype.stderr
    orphan = sparrow_cli("plugins", "--only", "ops", env=env)
    assert orphan.returncode == 2 and "--only applies only with --check DEVICE" in orphan.stderr


# -- the pytest plugin --------------------------------------------------------------------------
def run_pytest(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)  # an empty directory: the plugin's tests are all it collects
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "sparrow.conformance.pytest_plugin",
                           "-p", "no:cacheprovider", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=CHECK_TIMEOUT_S)


def test_pytest_plugin_makes_one_test_per_check(tmp_path):
    proc = run_pytest(tmp_path, "--sparrow-device=cpu", "--collect-only", "-q", env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [line for line in proc.stdout.splitlines() if line.startswith("sparrow-conformance[cpu]::")]
    assert ids == [f"sparrow-conformance[cpu]::{check.check_id}" for check in all_checks()]


def test_pytest_plugin_reports_the_perturbed_op(tmp_path):
    site = perturbed_copy(tmp_path)
    proc = run_pytest(tmp_path / "run", "--sparrow-device=cpu_broken", "--sparrow-only=ops,attention", "-v",
                      env=child_env(site))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "sparrow-conformance[cpu_broken]::ops/rms_norm FAILED" in proc.stdout
    assert "sparrow-conformance[cpu_broken]::attention/paged[gqa, d64] PASSED" in proc.stdout
    assert "ops/rms_norm failed: sparrow_broken_platform.ops:TorchRMSNorm: case '1x64'" in proc.stdout
    assert f"1 failed, {len(select_checks(['ops', 'attention'])) - 1} passed" in proc.stdout


# -- in-process: the pieces ---------------------------------------------------------------------
class ForgetsCachedContext(TorchPagedAttention):
    """A backend with a classic bug: a prefill attends only to its own new tokens, never to the
    context already in the cache (prefix hits and later chunks come out wrong)."""

    def forward(self, query, key, value, kv_cache, metadata):
        qsl = metadata.query_start_loc_cpu
        query_lens = (qsl[1:] - qsl[:-1]).to(torch.int32)
        if bool((query_lens == 1).all()):
            return super().forward(query, key, value, kv_cache, metadata)
        # Pretend every request is a fresh prefill of its new tokens.
        fresh = type(metadata)(
            num_actual_tokens=metadata.num_actual_tokens, num_reqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len, max_seq_len=int(query_lens.max()),
            query_start_loc=metadata.query_start_loc, seq_lens=query_lens, block_table=metadata.block_table,
            slot_mapping=metadata.slot_mapping, query_start_loc_cpu=qsl, seq_lens_cpu=query_lens)
        return super().forward(query, key, value, kv_cache, fresh)


def attention_ctx(backend_cls: type) -> SimpleNamespace:
    return SimpleNamespace(attention_backend_cls=lambda *shape: backend_cls, torch_dtype=torch.float32,
                           torch_device=torch.device("cpu"), platform=SimpleNamespace(default_block_size=16))


def test_attention_check_passes_the_cpu_backend_and_catches_a_broken_one():
    status, detail = attention_check(attention_ctx(TorchPagedAttention), "gqa, d64")
    assert status == "pass", detail
    status, detail = attention_check(attention_ctx(ForgetsCachedContext), "gqa, d64")
    assert status == "FAIL"
    # Step 1's fresh prefill (s0) is right; s1's chunk is too; s2's prefix hit is not.
    assert detail.startswith("step 1 (prefill, chunked prefill, prefix hit): layer 0: request 2 new token 0"), detail


def test_greedy_comparison_allows_only_near_ties():
    hf_logprobs = [torch.tensor([-0.1, -0.1005, -5.0]), torch.tensor([-0.2, -3.0, -4.0])]
    assert compare_with_hf([0, 0], ([0, 0], hf_logprobs), near_tie=1e-3) is None
    assert compare_with_hf([1, 2], ([0, 0], hf_logprobs), near_tie=1e-3) is None  # a tie at token 0: stop there
    assert compare_with_hf([0, 1], ([0, 0], hf_logprobs), near_tie=1e-3) == "token 1 is 1, HF 0 (HF logprob margin 2.8)"
    assert compare_with_hf([0], ([0, 0], hf_logprobs), near_tie=1e-3) == "1 tokens, HF 2"


def test_selection_results_and_report():
    assert [c.check_id for c in select_checks("attention")] == ["attention/paged[gqa, d64]",
                                                                "attention/paged[mha, d128]"]
    assert [c.check_id for c in select_checks(["engine/greedy*", "ops/draw"])] == [
        "ops/draw", "engine/greedy_vs_hf[llama]", "engine/greedy_vs_hf[qwen2]", "engine/greedy_vs_hf[qwen3]"]
    with pytest.raises(ValueError, match="only: 'engine/nope' matches no check"):
        select_checks("engine/nope")
    with pytest.raises(ValueError, match="only must name"):
        select_checks(" , ")

    crash = run_check(Check("engine", "crash", "sparrow.conformance.engine:random_prompts"), ctx=None)
    assert not crash.ok and crash.status == "FAIL" and crash.detail.startswith("raised TypeError")
    report = Report([CheckResult("ops", "a", True), CheckResult("ops", "b", True, "x", "native"), crash,
                     CheckResult("engine", "c", True, "none offered", "skip")])
    assert not report.ok and report.failures == [crash]
    assert report.summary() == "4 checks: 1 passed, 1 native, 1 skipped, 1 failed"
    assert report.table().splitlines()[2].split() == ["ops", "a", "pass"]
