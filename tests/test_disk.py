"""A run's folder: a write that fails ends the run in one line (exit 74), a folder
that cannot be made is refused before compiling (exit 2), and a folder in use is
refused naming its holder, while a killed holder's lock never blocks."""

import errno
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import types

import pytest

from jaxpipe import _loop, _writes, config, rundir, trainer
from jaxpipe.errors import ConfigError
from tests import _runs

SAVES = ("run.steps=30", "checkpoint.every=5")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
  """The uninterrupted run the resumed ones must equal: (run_dir, one checkpoint's bytes)."""
  run_dir = str(tmp_path_factory.mktemp("reference") / "run")
  p = _runs.run(run_dir, *SAVES, cache_dir=cache)
  assert p.returncode == 0, p.stderr
  ckpt = os.path.join(run_dir, "checkpoints", "30")
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
  return run_dir, size


def _can_mount_tmpfs(where) -> str:
  """'' where this process can mount a private tmpfs (a user and mount namespace), else why not."""
  if shutil.which("unshare") is None:
    return "no unshare command"
  p = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
                     capture_output=True, text=True)
  return "" if p.returncode == 0 else f"cannot mount a private tmpfs: {p.stderr.strip()}"


@pytest.mark.exit_status(74)
def test_a_full_disk_stops_the_run_in_one_line_and_the_rerun_resumes_exactly(
    tmp_path, cache, reference):
  disk = tmp_path / "disk"
  disk.mkdir()
  why = _can_mount_tmpfs(disk)
  if why:
    pytest.skip(why)
  ref_dir, ckpt_bytes = reference
  # Room for two checkpoints and the records, not for a third: the save of
  # step 15 fills the disk (keep=2 deletes the oldest only after a save).
  size_k = (ckpt_bytes * 2 + ckpt_bytes // 2 + 200_000) // 1024
  run_dir, out = disk / "run", tmp_path / "out"
  train = " ".join(_runs.command(str(run_dir), *SAVES))
  script = textwrap.dedent(f"""\
      set -u
      mount -t tmpfs -o size={size_k}k tmpfs {disk}
      {train} >{tmp_path}/full.out 2>{tmp_path}/full.err; echo $? >{tmp_path}/full.rc
      cp -r {run_dir} {tmp_path}/after_failure
      mount -o remount,size=256m {disk}
      {train} >{tmp_path}/rerun.out 2>{tmp_path}/rerun.err; echo $? >{tmp_path}/rerun.rc
      cp -r {run_dir} {out}
      """)
  subprocess.run(["unshare", "-rm", "sh", "-c", script], env=_runs.env(cache), cwd=_runs.ROOT,
                 check=True, timeout=600)
  err = (tmp_path / "full.err").read_text()
  assert (tmp_path / "full.rc").read_text().strip() == str(trainer.EXIT_IOERR) == "74", err
  lines = err.splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith("error: writing the checkpoint of step 15 to ")
  assert "(No space left on device)" in lines[0]
  assert "the newest intact checkpoint is step 10" in lines[0] and "free space" in lines[0]
  failed = str(tmp_path / "after_failure")
  assert _runs.checkpoints(failed) == [5, 10]
  # Stopped once the failure was known: orbax waits for step 15's save at the latest
  # when step 20's starts, and nothing after that ran.
  assert max(_runs.train_losses(failed)) < 20
  rerun_err = (tmp_path / "rerun.err").read_text()
  assert (tmp_path / "rerun.rc").read_text().strip() == "0", rerun_err
  assert _runs.train_losses(str(out)) == _runs.train_losses(ref_dir)
  assert _runs.val_losses(str(out)) == _runs.val_losses(ref_dir)


def _file_size_limit(limit):
  def pre():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
  return pre


@pytest.mark.exit_status(74)
def test_a_save_past_the_file_size_limit_exits_74_in_one_line(tmp_path, cache, reference):
  """The same path where no tmpfs can be mounted: the process's file size limit (a quota)."""
  run_dir = str(tmp_path / "run")
  _, ckpt_bytes = reference
  p = subprocess.run(_runs.command(run_dir, *SAVES), env=_runs.env(cache), cwd=_runs.ROOT,
                     capture_output=True, text=True, timeout=300,
                     preexec_fn=_file_size_limit(ckpt_bytes // 4))
  assert p.returncode == 74, p.stderr
  assert p.stderr.splitlines() == [p.stderr.strip()], p.stderr
  assert p.stderr.startswith("error: writing the checkpoint of step 5 to ")
  assert "(File too large)" in p.stderr and "there is no intact checkpoint yet" in p.stderr
  assert _runs.checkpoints(run_dir) == []


@pytest.mark.parametrize("where", ["proc", "below_a_file"])
def test_a_run_dir_that_cannot_be_made_exits_2_creating_nothing(tmp_path, cache, where):
  afile = tmp_path / "afile"
  afile.write_text("x")
  run_dir = "/proc/jaxpipe-run" if where == "proc" else str(afile / "sub")
  p = _runs.run(run_dir, cache_dir=cache, timeout=120)
  assert p.returncode == 2, p.stderr
  assert p.stderr.splitlines() == [p.stderr.strip()] and "Traceback" not in p.stderr
  assert p.stderr.startswith(f"error: run.dir={run_dir} cannot be created")
  assert sorted(os.listdir(tmp_path)) == ["afile"] and not os.path.exists(run_dir)


def test_the_folder_is_refused_before_anything_is_built(tmp_path, monkeypatch):
  afile = tmp_path / "afile"
  afile.write_text("x")
  cfg = config.load(_runs.TINY, [f"run.dir={afile}/sub"])

  def never(*args, **kwargs):
    raise AssertionError("built a run for a folder that cannot be made")
  monkeypatch.setattr(trainer, "make_run", never)
  with pytest.raises(ConfigError, match="is not a folder"):
    trainer.train(cfg)
  rundir.check_writable(str(tmp_path / "new" / "deeper"))  # creatable: no error
  assert sorted(os.listdir(tmp_path)) == ["afile"]  # the probe left nothing


_HOLDER = ("import sys; from jaxpipe import rundir; lock = rundir.hold(sys.argv[1]); "
           "print('held', flush=True); sys.stdin.read()")


def _hold_in_another_process(run_dir):
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER, run_dir], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, cwd=_runs.ROOT)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_second_run_in_a_folder_in_use_is_refused_and_a_killed_holder_blocks_nothing(
    tmp_path, cache):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  holder = _hold_in_another_process(str(run_dir))
  try:
    p = _runs.run(str(run_dir), "run.steps=2", cache_dir=cache, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [p.stderr.strip()], p.stderr
    assert f"is in use by process {holder.pid} on host {socket.gethostname()}" in p.stderr
    assert os.listdir(run_dir) == [rundir.LOCK_NAME]  # the refused run wrote nothing
  finally:
    holder.kill()  # SIGKILL: the holder never releases, the kernel does
    holder.wait()
  p = _runs.run(str(run_dir), "run.steps=2", cache_dir=cache, timeout=120)
  assert p.returncode == 0, p.stderr
  assert rundir.holder(str(run_dir)) is None


def test_the_lock_names_its_holder_and_is_free_once_released(tmp_path):
  assert rundir.holder(str(tmp_path)) is None
  lock = rundir.hold(str(tmp_path))
  try:
    held = rundir.holder(str(tmp_path))
    assert held.startswith(f"process {os.getpid()} on host {socket.gethostname()} (since ")
    with pytest.raises(ConfigError, match=f"in use by process {os.getpid()} "):
      rundir.hold(str(tmp_path))  # another open file: flock refuses even this process
  finally:
    lock.release()
  assert rundir.holder(str(tmp_path)) is None
  rundir.hold(str(tmp_path)).release()
  assert os.path.getsize(tmp_path / rundir.LOCK_NAME) == 0


def test_a_failed_metrics_write_is_a_write_failure(tmp_path):
  metrics = _loop.Metrics(str(tmp_path), 0, 0, True)

  class Full:
    def write(self, text):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  metrics._file = Full()
  with pytest.raises(_writes.WriteFailed) as failed:
    metrics.write({"step": 0, "loss": 1.0})
  failed.value.newest, failed.value.checkpoint_dir = 4, str(tmp_path / "checkpoints")
  said = str(failed.value)
  assert said.startswith(f"writing metrics.jsonl to {tmp_path}/metrics.jsonl failed "
                         "(No space left on device); the run stopped: the newest intact "
                         "checkpoint is step 4")
  metrics.close(abandon=True)  # neither raises nor waits on TensorBoard's thread


def test_a_writer_thread_that_dies_is_kept_not_printed(tmp_path, capsys):
  class Writer(threading.Thread):  # where TensorBoard's writer thread comes from
    __module__ = "tensorboardX.event_file_writer"

    def run(self):
      raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
  with _writes.Watch() as watch:
    metrics = _loop.Metrics(str(tmp_path), 0, 0, True, watch)
    thread = Writer()
    thread.start()
    thread.join()
    assert isinstance(watch.thread_error(), OSError)
    if metrics._tb is not None:  # TensorBoard installed: its thread would block the loop
      with pytest.raises(_writes.WriteFailed, match="Disk quota exceeded"):
        metrics.write({"step": 0, "loss": 1.0})
    metrics.close(abandon=True)
  assert "Traceback" not in capsys.readouterr().err
  assert threading.excepthook is not watch._hook  # the hook is put back


def test_a_write_failure_reads_its_reason_from_any_error():
  assert _writes.reason(OSError(errno.ENOSPC, "No space left on device")) == (
      "No space left on device")
  tensorstore = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/x\": Failed to "
                           "write 10593 bytes to file 11: No space left on device "
                           "[os_error_code='28']")
  assert _writes.reason(tensorstore) == os.strerror(28)
  assert _writes.reason(RuntimeError("first\nsecond")) == "first"


def test_only_tensorboards_thread_is_taken_for_a_failed_write(monkeypatch):
  def dies():
    raise OSError(errno.ECONNRESET, os.strerror(errno.ECONNRESET))
  seen = []
  monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_type))
  with _writes.Watch() as watch:
    thread = threading.Thread(target=dies)  # not a writer into the run folder
    thread.start()
    thread.join()
    assert watch.thread_error() is None
  assert seen == [ConnectionResetError]  # handed to the hook that was there before


def test_an_oserror_on_a_file_of_the_run_folder_is_a_write_failure(tmp_path):
  inside = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "config.yaml"))
  failed = _writes.from_oserror(inside, str(tmp_path))
  assert failed is not None and failed.what == "config.yaml"
  assert "(No space left on device)" in str(failed)
  outside = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/elsewhere/file")
  assert _writes.from_oserror(outside, str(tmp_path)) is None
  other = OSError(errno.ECONNRESET, os.strerror(errno.ECONNRESET), str(tmp_path / "x"))
  assert _writes.from_oserror(other, str(tmp_path)) is None


def test_a_closed_event_loop_after_a_failed_write_is_not_printed(capsys, monkeypatch):
  """tensorstore's late callbacks into orbax's closed loop, while train.py says its one line."""
  seen = []
  monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
  monkeypatch.setattr(sys, "unraisablehook", lambda args: seen.append(args.exc_value))
  monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
  before = sys.excepthook, sys.unraisablehook, threading.excepthook
  closed, other = RuntimeError("Event loop is closed"), RuntimeError("something else")
  with pytest.raises(_writes.WriteFailed):
    with _writes.Watch():
      raise _writes.WriteFailed("a checkpoint", "/x", OSError(errno.EFBIG, "File too large"))
  # Still filtered after the failure left the block: the process is on its way out.
  absl = logging.getLogger("absl")
  late = logging.LogRecord("absl", logging.ERROR, f"{os.sep}x{os.sep}orbax{os.sep}future.py", 1,
                           "a background save failed", None, None)
  assert not absl.filter(late)  # orbax's late log of the same failure
  sys.excepthook(RuntimeError, closed, None)
  sys.unraisablehook(types.SimpleNamespace(exc_value=closed))
  sys.excepthook(RuntimeError, other, None)
  assert seen == [other]
  # The next watch (a later run in the same process) puts back what was there
  # before the first, and sees orbax's logs itself.
  with _writes.Watch() as watch:
    assert not any(isinstance(f, _writes._OrbaxErrors) and f is not watch._orbax
                   for f in absl.filters)
  assert (sys.excepthook, sys.unraisablehook, threading.excepthook) == before
  sys.excepthook(RuntimeError, closed, None)
  assert seen == [other, closed]
  assert not any(isinstance(f, _writes._OrbaxErrors) for f in absl.filters)
  assert "Traceback" not in capsys.readouterr().err
