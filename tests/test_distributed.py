"""Two processes on loopback, each with two emulated CPU devices, form one 2x2 mesh.

Each process is a node (CPU devices carry no slice index), so `mesh.layout`
decides which mesh axis spans the two; `local_device_ids` come from the
launcher's variables and reach `jax.distributed.initialize` (on CPU devices
they select nothing). A process killed or stopped mid-run ends the other
within seconds, with one line and EXIT_LOST, and the rerun continues exactly.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from jaxpipe import runs, trainer
from tests import _runs

ARGS = ("pipeline.schedule=2bw", "pipeline.stages=2", "mesh.data=2", "run.steps=4",
        "checkpoint.every=2", "optimizer.name=muon", "optimizer.error_feedback=1")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_device_env(cache, devices=2, **extra):
  env = _runs.env(cache)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  env.update(extra)
  return env


def _run_two(run_dir, *args, envs, pins=None):
  """Runs the two processes of a loopback job; returns their (stdout, stderr).

  `pins`: each process's CPU core, set with taskset.
  """
  port = _free_port()
  procs = [subprocess.Popen(
      (["taskset", "-c", str(pins[i])] if pins else [])
      + _runs.command(run_dir, *args, f"dist.coordinator=127.0.0.1:{port}",
                      "dist.num_processes=2", f"dist.process_id={i}"),
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


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs taskset and two cores")
def test_a_process_per_core_runs_the_io_thread_idle_class(tmp_path, cache):
  """With the CPU tuning's launch hooks (tools/cpu/tuning.py), a stage and a core per
  process: gloo's I/O thread yields its core; the losses hold."""
  args = ("pipeline.schedule=2bw", "pipeline.stages=2", "mesh.data=1", "run.steps=2",
          "checkpoint.every=0", "optimizer.name=muon", "optimizer.error_feedback=1",
          "run.launch_hooks=tools.cpu.tuning")
  single = str(tmp_path / "single")
  assert _runs.run(single, *args, cache_dir=cache).returncode == 0
  pins = sorted(os.sched_getaffinity(0))[:2]
  env = _two_device_env(cache, devices=1)
  multi = str(tmp_path / "multi")
  outs = _run_two(multi, *args, envs=[env, env], pins=pins)
  for i in range(2):
    assert re.search(rf"process {i}: gloo's I/O thread [0-9]+ runs idle-class "
                     r"\(1 core for 1 device; JAXPIPE_CPU_IO_THREAD\)", outs[i][1]), outs[i][1]
  a, b = _runs.train_losses(single), _runs.train_losses(multi)
  assert [b[k] for k in range(2)] == pytest.approx([a[k] for k in range(2)], rel=1e-6, abs=0)
  # Turned off, the hooks leave it alone (a spare core: test_cpu_tuning).
  off_env = dict(env, JAXPIPE_CPU_IO_THREAD="normal")
  off = _run_two(str(tmp_path / "off"), *args, envs=[off_env, off_env], pins=pins)
  assert not any("gloo's I/O thread" in err for _, err in off)
  assert _runs.train_losses(str(tmp_path / "off")) == b


# A pipeline over the two processes, a stage (one device) each: every tick's
# transfers cross them. Short timeouts, so a loss is noticed in seconds; enough
# steps that the run is still going when the test stops a process after the
# checkpoint of step 3.
LOST = ("pipeline.schedule=2bw", "pipeline.stages=2", "mesh.data=1", "run.steps=24",
        "checkpoint.every=3", "optimizer.name=muon", "optimizer.error_feedback=1",
        "dist.heartbeat_timeout_s=3")


def _start_two(run_dir, tmp_path, *args, env, tag):
  """Starts the two processes of a loopback job, their output in files; returns the Popens."""
  port = _free_port()
  procs = []
  for i in range(2):
    with open(tmp_path / f"{tag}{i}.out", "w") as out, open(tmp_path / f"{tag}{i}.err", "w") as err:
      procs.append(subprocess.Popen(
          _runs.command(run_dir, *args, f"dist.coordinator=127.0.0.1:{port}",
                        "dist.num_processes=2", f"dist.process_id={i}"),
          env=env, stdout=out, stderr=err, text=True, cwd=_runs.ROOT))
  return procs


@pytest.fixture(scope="module")
def whole(tmp_path_factory, cache):
  """An uninterrupted two-process run of LOST: the losses a resumed run must equal."""
  tmp = tmp_path_factory.mktemp("whole")
  run_dir = str(tmp / "run")
  codes = _run_two_to_end(run_dir, tmp, cache, "whole")
  assert codes == [0, 0], (tmp / "whole0.err").read_text()
  return _runs.train_losses(run_dir)


def _run_two_to_end(run_dir, tmp, cache, tag):
  """Runs LOST on two processes until both exit (killed after 300 s); their exit statuses."""
  procs = _start_two(run_dir, tmp, *LOST, env=_two_device_env(cache, devices=1), tag=tag)
  try:
    for proc in procs:
      proc.wait(timeout=300)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  return [p.returncode for p in procs]


def _checkpoint_3(run_dir):
  return 3 in _runs.checkpoints(run_dir)


def _lose_one(tmp_path, cache, victim, sig, *more, ready=_checkpoint_3):
  """Runs LOST on two processes, sends `sig` to `victim` once `ready(run_dir)` (by default
  after checkpoint 3); returns (the survivor's exit status, seconds from the loss to its
  exit, its stderr, run_dir)."""
  run_dir = str(tmp_path / "run")
  procs = _start_two(run_dir, tmp_path, *LOST, *more, env=_two_device_env(cache, devices=1),
                     tag="lost")
  survivor = procs[1 - victim]
  try:
    assert _runs.wait_for(lambda: ready(run_dir) or survivor.poll() is not None,
                          timeout=300, interval=0.01)
    assert survivor.poll() is None, (tmp_path / f"lost{1 - victim}.err").read_text()
    procs[victim].send_signal(sig)
    assert _runs.wait_for(lambda: _runs.stopped(procs[victim]), timeout=10, interval=0.01)
    lost_at = time.time()
    survivor.wait(timeout=90)
    took = time.time() - lost_at
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  err = (tmp_path / f"lost{1 - victim}.err").read_text()
  return survivor.returncode, took, err, run_dir


def _says_lost_in_one_line(err, status, *named):
  assert status == trainer.EXIT_LOST == 69, err
  # One line, and no traceback or C++ abort (the coordination service's own
  # missed-heartbeat handler dumps a stack and raises SIGABRT).
  assert "Traceback" not in err and "Check failure" not in err and "*** " not in err, err
  lines = [l for l in err.splitlines() if l.startswith("error: ")]
  assert len(lines) == 1, err
  for text in named:
    assert text in lines[0], lines[0]
  assert "run the same command again on every process" in lines[0]
  return lines[0]


def _resume_equals_whole(tmp_path, cache, run_dir, whole):
  """Both processes rerun the same command: the losses equal the uninterrupted run's exactly."""
  codes = _run_two_to_end(run_dir, tmp_path, cache, "again")
  err = (tmp_path / "again0.err").read_text()
  assert codes == [0, 0], err
  assert "resuming from " in err
  losses = _runs.train_losses(run_dir)
  assert sorted(losses) == sorted(whole) == list(range(24))
  assert [losses[k] for k in range(24)] == [whole[k] for k in range(24)]


def test_a_peer_stopped_around_a_save_ends_the_run(tmp_path, cache):
  """Stopped as soon as checkpoint 3 is on disk, the survivor may still be inside that save
  (which stops the step clock): dist.save_timeout_s bounds the save, the step watchdog the rest.

  A save waits at barriers for every process; without that bound a peer
  that hung there with its heartbeats going on would hold the survivor
  forever (heartbeats too slow to notice here, as for a hung peer).
  """
  status, took, err, _ = _lose_one(tmp_path, cache, 1, signal.SIGSTOP,
                                   "dist.heartbeat_timeout_s=120", "dist.step_timeout_s=4",
                                   "dist.save_timeout_s=4")
  assert status == trainer.EXIT_LOST, err
  lines = [l for l in err.splitlines() if l.startswith("error: ")]
  assert len(lines) == 1 and "Traceback" not in err, err
  assert ("did not finish in" in lines[0] and "dist.save_timeout_s=4" in lines[0]
          or "no training step finished for" in lines[0] and "dist.step_timeout_s=4" in lines[0]
          ), lines[0]
  assert "process 0 stopped without saving" in lines[0]
  assert took < 20, took


@pytest.mark.parametrize("victim,sig", [(1, signal.SIGKILL), (0, signal.SIGSTOP)],
                         ids=["sigkill-process-1", "sigstop-process-0"])
@pytest.mark.exit_status(69)
def test_a_lost_process_ends_the_other_with_one_line(tmp_path, cache, whole, victim, sig):
  """Killed (the coordination service notices) or stopped (its heartbeats stop): the
  other process leaves within seconds with EXIT_LOST and one line; the rerun is exact.

  Process 0 holds the coordination service, so stopping it is the case where
  the survivor must notice that the service itself went quiet.
  """
  status, took, err, run_dir = _lose_one(tmp_path, cache, victim, sig)
  line = _says_lost_in_one_line(err, status, f"lost process {victim} of 2",
                                f"process {1 - victim} stopped without saving")
  # Within the heartbeat timeout (3 s) and the time the service takes to tell.
  assert took < 20, (took, line)
  # A checkpoint being written when the peer went is never taken for a committed one.
  _resume_equals_whole(tmp_path, cache, run_dir, whole)


def test_a_step_that_makes_no_progress_ends_the_run(tmp_path, cache):
  """A stopped peer with heartbeats too slow to notice: dist.step_timeout_s does.

  The peer is stopped while the survivor steps: no periodic checkpoint, and
  the survivor (process 0, which writes the metrics) has recorded batch 3.
  A save stops the step clock (its time is the disk's); a peer stopped
  during one is dist.save_timeout_s's case (the test before this one).
  """
  status, took, err, _ = _lose_one(
      tmp_path, cache, 1, signal.SIGSTOP, "checkpoint.every=0", "run.steps=1000",
      "dist.heartbeat_timeout_s=120", "dist.step_timeout_s=4",
      ready=lambda run_dir: max(runs.losses(run_dir), default=-1) >= 3)
  _says_lost_in_one_line(err, status, "no training step finished for",
                         "dist.step_timeout_s=4", "process 0 stopped without saving")
  assert took < 20, took
