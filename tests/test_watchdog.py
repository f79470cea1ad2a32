"""The pieces that end a run of several processes when one is lost, without processes.

`tests/test_distributed.py` kills and stops real processes; here the step
watchdog runs on a clock the test moves, and the coordination service's
statuses are read as text.
"""

import threading

import pytest

from jaxpipe import _watchdog, config as config_lib, trainer
from jaxpipe.errors import ConfigError
from tests import _runs


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_the_watchdog_fires_only_when_armed_unpaused_and_late():
  clock = _Clock()
  dog = _watchdog.Watchdog(10, on_timeout=lambda s: None, clock=clock)
  clock.now = 1000.0
  assert dog.overdue() is None          # not armed: the first step compiles
  dog.beat()
  clock.now += 9.5
  assert dog.overdue() is None
  clock.now += 1.0
  assert dog.overdue() == pytest.approx(10.5)
  dog.beat()
  assert dog.overdue() is None
  with dog.paused():                     # a checkpoint save: the clock stops
    clock.now += 100
    assert dog.overdue() is None
  assert dog.overdue() is None           # and restarts from zero
  clock.now += 10.5
  assert dog.overdue() == pytest.approx(10.5)
  assert _watchdog.Watchdog(0, clock=clock).overdue() is None  # 0 = off


def test_the_watchdog_thread_calls_on_timeout_once():
  fired = threading.Event()
  seen = []

  def on_timeout(seconds):
    seen.append(seconds)
    fired.set()

  with _watchdog.Watchdog(0.2, on_timeout=on_timeout) as dog:
    dog.beat()
    assert fired.wait(5)
  assert len(seen) == 1 and seen[0] > 0.2
  # Beats keep it quiet.
  fired.clear()
  with _watchdog.Watchdog(0.4, on_timeout=on_timeout) as dog:
    for _ in range(10):
      dog.beat()
      assert not fired.wait(0.1)


def test_the_lost_process_is_read_from_the_services_status():
  status = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
            "/job:jax_worker/replica:0/task:1\nThe tasks have crashed.")
  assert _watchdog.lost_process(status, 0) == (1, "its heartbeats stopped")
  # Process 0 holds the service: a failed heartbeat from elsewhere means process 0 is gone.
  who, _ = _watchdog.lost_process("UNAVAILABLE: failed to connect to all addresses", 1)
  assert who == 0
  who, reason = _watchdog.lost_process("INTERNAL: something else", 0)
  assert who is None and "something else" in reason


def test_the_line_names_the_process_and_the_command(tmp_path):
  (tmp_path / "checkpoints" / "3").mkdir(parents=True)
  (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()  # uncommitted: not named
  _watchdog.configure(str(tmp_path), 0, 2, 3)
  try:
    line = _watchdog.message("its heartbeats stopped", 1)
  finally:
    _watchdog.configure("", 0, 1, 0)
  assert "\n" not in line
  assert line.startswith("error: lost process 1 of 2 (its heartbeats stopped); process 0 stopped "
                         f"without saving (exit {trainer.EXIT_LOST})")
  assert f"from step 3 (the newest checkpoint in {tmp_path}/checkpoints)" in line
  assert "run the same command again on every process" in line


def test_exit_lost_is_its_own_status():
  assert trainer.EXIT_LOST == 69
  assert trainer.EXIT_LOST not in (2, trainer.EXIT_NONFINITE, trainer.EXIT_INTERRUPTED)
  assert trainer.EXIT_LOST < trainer.EXIT_SIGNAL
  assert "EXIT_LOST" in trainer.__all__


@pytest.mark.parametrize("key", ["heartbeat_timeout_s", "init_timeout_s", "shutdown_timeout_s"])
def test_dist_timeouts_are_checked(key):
  assert getattr(config_lib.load(_runs.TINY, [f"dist.{key}=7"]).dist, key) == 7
  with pytest.raises(ConfigError, match=f"^dist.{key} must be >= 1 \\(seconds\\), got 0$"):
    config_lib.load(_runs.TINY, [f"dist.{key}=0"])


def test_step_timeout_is_checked():
  assert config_lib.load(_runs.TINY, ["dist.step_timeout_s=0"]).dist.step_timeout_s == 0
  with pytest.raises(ConfigError, match="^dist.step_timeout_s must be >= 0"):
    config_lib.load(_runs.TINY, ["dist.step_timeout_s=-1"])
