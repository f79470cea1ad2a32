"""Two processes on loopback, each with two emulated CPU devices, form one 2x2 mesh.

Each process is a node (CPU devices carry no slice index), so `mesh.layout`
decides which mesh axis spans the two; `local_device_ids` come from the
launcher's variables and reach `jax.distributed.initialize` (on CPU devices
they select nothing).
"""

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


def _two_device_env(cache, **extra):
  env = _runs.env(cache)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=2"])
  env.update(extra)
  return env


def _run_two(run_dir, *args, envs):
  """Runs the two processes of a loopback job; returns their (stdout, stderr)."""
  port = _free_port()
  procs = [subprocess.Popen(
      _runs.command(run_dir, *args, f"dist.coordinator=127.0.0.1:{port}", "dist.num_processes=2",
                    f"dist.process_id={i}"),
      env=envs[i], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_runs.ROOT)
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
  return outs


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


def test_two_processes_match_one_process(tmp_path, cache):
  single = str(tmp_path / "single")
  p = _runs.run(single, *ARGS, cache_dir=cache)
  assert p.returncode == 0, p.stderr

  multi = str(tmp_path / "multi")
  env = _two_device_env(cache)
  outs = _run_two(multi, *ARGS, envs=[env, env])
  # Process 0 writes the metrics and prints the summary; process 1 stays quiet.
  assert "jaxpipe 2bw" in outs[0][0] and "jaxpipe 2bw" not in outs[1][0]
  assert "emulating 4 devices on the CPU (2 per process)" in outs[0][1]
  # The default layout: each process (node) holds one stage with both replicas.
  assert "mesh stage x data = 2 x 2: stage across nodes (mesh.layout=stage)" in outs[0][1]
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


def test_data_across_nodes_with_local_ranks(tmp_path, cache):
  """mesh.layout=data: each process holds one replica of both stages; same losses."""
  args = ARGS[:3] + ("run.steps=2", "checkpoint.every=0") + ARGS[5:]
  single = str(tmp_path / "single")
  assert _runs.run(single, *args, cache_dir=cache).returncode == 0
  multi = str(tmp_path / "multi")
  envs = [_two_device_env(cache, LOCAL_RANK=str(i), LOCAL_WORLD_SIZE="2") for i in range(2)]
  outs = _run_two(multi, *args, "mesh.layout=data", envs=envs)
  for i in range(2):
    assert f"process {i} of 2: local_device_ids {i}" in outs[i][1]
  assert "mesh stage x data = 2 x 2: data across nodes (mesh.layout=data)" in outs[0][1]
  a, b = _runs.train_losses(single), _runs.train_losses(multi)
  assert sorted(a) == sorted(b) == [0, 1]
  assert [b[k] for k in range(2)] == pytest.approx([a[k] for k in range(2)], rel=1e-6, abs=0)
