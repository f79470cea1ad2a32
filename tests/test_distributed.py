"""Two processes on loopback, each with two emulated CPU devices, form one 2x2 mesh."""

import os
import socket
import subprocess

import pytest

from tests import _runs

ARGS = ("pipeline.schedule=2bw", "pipeline.stages=2", "mesh.data=2", "run.steps=4",
        "checkpoint.every=2", "optimizer.name=muon", "optimizer.error_feedback=1")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_device_env(cache):
  env = _runs.env(cache)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=2"])
  return env


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


def test_two_processes_match_one_process(tmp_path, cache):
  single = str(tmp_path / "single")
  p = _runs.run(single, *ARGS, cache_dir=cache)
  assert p.returncode == 0, p.stderr

  multi = str(tmp_path / "multi")
  port = _free_port()
  env = _two_device_env(cache)
  procs = [subprocess.Popen(
      _runs.command(multi, *ARGS, f"dist.coordinator=127.0.0.1:{port}", "dist.num_processes=2",
                    f"dist.process_id={i}"),
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_runs.ROOT)
           for i in range(2)]
  outs = []
  try:
    for proc in procs:
      outs.append(proc.communicate(timeout=300))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for proc, (out, err) in zip(procs, outs):
    assert proc.returncode == 0, err
  # Process 0 writes the metrics and prints the summary; process 1 stays quiet.
  assert "jaxpipe 2bw" in outs[0][0] and "jaxpipe 2bw" not in outs[1][0]
  assert "emulating 4 devices on the CPU (2 per process)" in outs[0][1]
  a, b = _runs.train_losses(single), _runs.train_losses(multi)
  assert sorted(a) == sorted(b) == [0, 1, 2, 3]
  assert [b[k] for k in range(4)] == pytest.approx([a[k] for k in range(4)], rel=1e-6, abs=0)
  assert _runs.val_losses(multi)[4] == pytest.approx(_runs.val_losses(single)[4], rel=1e-6)
  assert _runs.checkpoints(multi) == [2, 4]
  assert os.path.exists(os.path.join(multi, "checkpoints", "4", "state"))

  # The two processes' checkpoint continues in one process on a 2 x 1 mesh
  # (2bw's in-flight state rebuilt), as the one-process run continues on its own.
  more = ("run.steps=6",)
  assert _runs.run(single, *ARGS, *more, cache_dir=cache).returncode == 0
  p = _runs.run(multi, *ARGS, *more, "mesh.data=1", cache_dir=cache)
  assert p.returncode == 0, p.stderr
  assert "resharded the checkpoint" in p.stderr
  a, b = _runs.train_losses(single), _runs.train_losses(multi)
  assert sorted(a) == sorted(b) == list(range(6))
  assert [b[k] for k in range(6)] == pytest.approx([a[k] for k in range(6)], rel=1e-6, abs=0)
