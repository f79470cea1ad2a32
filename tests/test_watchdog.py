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


def test_a_paused_section_has_a_bound_of_its_own():
  """A save stops the step clock but not its own: a peer hung at a save's barrier ends the run."""
  clock = _Clock()
  dog = _watchdog.Watchdog(10, on_timeout=lambda s: None, clock=clock, pause_timeout_s=60)
  with dog.paused():                     # before the first step: compilation, not bounded
    clock.now += 1000
    assert dog.overdue() is None
  dog.beat()
  with dog.paused():
    clock.now += 59
    with dog.paused():                   # nested: the outer pause's start counts
      clock.now += 0.5
      assert dog.overdue() is None
    clock.now += 1.0
    assert dog.overdue() == pytest.approx(60.5)
  assert dog.overdue() is None           # the step clock restarted at the pause's end
  clock.now += 10.5
  assert dog.overdue() == pytest.approx(10.5)
  # 0 leaves a pause unbounded, as before.
  dog = _watchdog.Watchdog(10, on_timeout=lambda s: None, clock=clock)
  dog.beat()
  with dog.paused():
    clock.now += 10 ** 6
    assert dog.overdue() is None


def test_a_late_pause_is_reported_as_a_save(monkeypatch):
  """The line names the bound that ran out: dist.save_timeout_s inside a pause."""
  said = []
  guard = _watchdog.Guard()
  monkeypatch.setattr(guard, "lost", lambda reason, who=None: said.append(reason))
  clock = _Clock()
  dog = _watchdog.Watchdog(10, clock=clock, pause_timeout_s=60, guard=guard)
  dog.beat()
  with dog.paused():
    clock.now += 61
    dog.on_timeout(dog.overdue())
  clock.now += 11
  dog.on_timeout(dog.overdue())
  assert "did not finish in 61 s (dist.save_timeout_s=60)" in said[0]
  assert "no training step finished for 11 s (dist.step_timeout_s=10)" in said[-1]


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


class _Store:
  """The coordination service's key-value store, as the client shows it; `down` stops it."""

  def __init__(self):
    self.kv, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect")
    assert allow_overwrite or key not in self.kv
    self.kv[key] = value

  def key_value_try_get(self, key):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect")
    if key not in self.kv:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.kv[key]


def test_peers_watch_the_next_process_and_the_service():
  clock, store = _Clock(), _Store()
  peers = [_watchdog.Peers(store, i, 3, 10, on_lost=lambda *a: None, clock=clock)
           for i in range(3)]
  assert [p.watched for p in peers] == [1, 2, 0]
  for count in range(1, 4):   # rounds every 2 s: all alive
    clock.now += 2
    for p in peers:
      assert p._exchange(count) is None and p.check() is None
  # Process 2 stops: process 1, which watches it, notices after the timeout.
  for count in range(4, 11):
    clock.now += 2
    for p in peers[:2]:
      p._exchange(count)
  assert peers[0].check() is None
  assert peers[1].check() == (2, "no heartbeat for 12 s")
  # The watcher tells everyone; the others read it in their next round.
  peers[1]._declare(2, "no heartbeat for 12 s")
  assert peers[0]._exchange(11) == (2, "no heartbeat for 12 s")
  # A finished process is never taken for a lost one.
  clock, store = _Clock(), _Store()
  a, b = (_watchdog.Peers(store, i, 2, 10, on_lost=lambda *x: None, clock=clock) for i in range(2))
  a._exchange(1)
  b._exchange(1)
  b.stop(done=True)
  clock.now += 60
  assert a._exchange(2) is None and a.check() is None
  # The service (process 0) stops answering: process 1 counts process 0 lost.
  clock, store = _Clock(), _Store()
  b = _watchdog.Peers(store, 1, 2, 10, on_lost=lambda *x: None, clock=clock)
  store.down = True
  clock.now += 11
  assert b._exchange(1) is None
  who, reason = b.check()
  assert who == 0 and "coordination service in process 0 did not answer" in reason


def test_peers_threads_act_on_a_loss():
  store, seen, fired = _Store(), [], threading.Event()

  def on_lost(who, reason):
    seen.append((who, reason))
    fired.set()

  peers = _watchdog.Peers(store, 0, 2, 0.5, on_lost=on_lost).start()
  try:
    assert fired.wait(10)   # process 1 never publishes
  finally:
    peers.stop(done=False)
  assert seen[0][0] == 1 and store.kv["jaxpipe/peers/lost"].startswith("1:")


def test_jax_heartbeats_are_only_the_backstop():
  for ours in (1, 3, 15, 100):
    assert _watchdog.jax_heartbeat_timeout(ours) >= 2 * ours + 10


def test_the_line_names_the_process_and_the_command(tmp_path):
  (tmp_path / "checkpoints" / "3").mkdir(parents=True)
  (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()  # uncommitted: not named
  line = _watchdog.Guard(str(tmp_path), 0, 2, 3).message("its heartbeats stopped", 1)
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


@pytest.mark.parametrize("key", ["step_timeout_s", "save_timeout_s"])
def test_step_and_save_timeouts_are_checked(key):
  assert getattr(config_lib.load(_runs.TINY, [f"dist.{key}=0"]).dist, key) == 0
  with pytest.raises(ConfigError, match=f"^dist.{key} must be >= 0"):
    config_lib.load(_runs.TINY, [f"dist.{key}=-1"])
