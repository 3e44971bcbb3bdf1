"""The benchmark's load meter tells our processes' CPU time from everyone else's (Linux /proc)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparrow.bench import machine_load

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")

# Burns one second of CPU time (not wall time: the count does not depend on how busy the machine is).
BURN = "import time\nwhile time.process_time() < 1.0: pass\n"


def _own_ticks() -> int:
    import os

    return machine_load._tree_ticks(os.getpid())


def test_a_child_counts_as_ours():
    before = _own_ticks()
    subprocess.run([sys.executable, "-c", BURN], check=True)
    # The reaped child's time is in our cutime: at least 0.9 s of it is ours.
    assert _own_ticks() - before >= 0.9 * machine_load._CLOCK_TICKS


def test_a_process_outside_our_tree_does_not():
    # A detached grandchild (its parent exits at once) is re-parented away from us.
    launcher = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {BURN!r}])\n"
                "print(p.pid, flush=True)\n")
    before = _own_ticks()
    pid = int(subprocess.run([sys.executable, "-c", launcher], check=True, capture_output=True, text=True).stdout)
    # Wait for the orphan to finish its second of CPU without reaping it (it is not our child).
    while Path(f"/proc/{pid}").exists():
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.2)
    spent = _own_ticks() - before
    # The launcher, our own, costs well under a second.
    assert spent < 0.9 * machine_load._CLOCK_TICKS


def test_meter_reports_shares():
    meter = machine_load.LoadMeter()
    meter.start()
    subprocess.run([sys.executable, "-c", BURN], check=True)
    load = meter.stop()
    assert load is not None and set(load) == {"others_cores", "steal_cores"}
    assert all(value >= 0.0 for value in load.values())


def test_speed_probe_and_the_table_line_that_reports_it():
    """The probe measures real work (positive, finite), and the table puts each run's time beside
    the machine's speed after it: equal work at half the speed is no spread at all."""
    from sparrow.bench.throughput import print_table

    speed = machine_load.probe_speed(0.05)
    assert 1e6 < speed < 1e15
    result = {
        "num_prompts": 2, "prompt_tokens": 10, "output_tokens": 10, "engine_elapsed_s": 2.0,
        "engine_output_tok_s": 5.0, "engine_total_tok_s": 10.0, "num_params": 1e6, "matmul_flops": 1e9,
        "roofline_share": 0.5, "machine": "test", "torch": "x", "date": "today",
        "engine_all_elapsed_s": [1.0, 2.0],
        "engine_machine_load": [{"others_cores": 0.0, "steal_cores": 0.0, "probe_flops": 2e9},
                                {"others_cores": 0.0, "steal_cores": 0.0, "probe_flops": 1e9}],
    }
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table(result)
    text = out.getvalue()
    assert "2: 1.00-2.00, slowest/fastest 2.00" in text
    assert "1.0-2.0 GFLOP/s; runs x speed: slowest/fastest 1.00" in text
