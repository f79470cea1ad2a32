"""The accelerator benchmark in its CPU mode: every schedule gets a finite throughput."""

import os
import subprocess
import sys

import pytest

from tests import _runs


# The benchmark tools end to end (compiling and timing in pinned processes):
# not in the default run, which must stay under 15 minutes on 2 cores;
# `.venv/bin/python -m pytest -m slow` runs them.
@pytest.mark.slow
def test_cpu_preset_reports_each_schedule(tmp_path):
  out = tmp_path / "bench.md"
  p = subprocess.run([sys.executable, os.path.join(_runs.ROOT, "tools", "bench_accel.py"),
                      "--preset", "cpu", "--schedules", "none,2bw", "--steps", "1",
                      "--batch", "32", "--seq", "32", "--out-md", str(out)],
                     capture_output=True, text=True, timeout=600, cwd=_runs.ROOT)
  assert p.returncode == 0, p.stderr
  rows = [l for l in out.read_text().splitlines() if l.startswith("| none") or l.startswith("| 2bw")]
  assert len(rows) == 2
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[3].replace(",", "")) > 0  # tokens/s
    assert cells[5] == "n/a"                      # no MFU without a known peak
  assert "| 2bw | 2x4 |" in out.read_text()


def test_bad_schedule_exits_2():
  p = subprocess.run([sys.executable, os.path.join(_runs.ROOT, "tools", "bench_accel.py"),
                      "--preset", "cpu", "--schedules", "zigzag"],
                     capture_output=True, text=True, timeout=300, cwd=_runs.ROOT)
  assert p.returncode == 2
  assert p.stderr.strip().splitlines() == [
      "error: unknown schedule 'zigzag'; choose from none, gpipe, 1f1b, 2bw, pipedream"]
