"""The training loop's pieces (jaxpipe/_loop.py) on their own, without training."""

import json
import os
import signal

import numpy as np
import pytest

from jaxpipe import _loop
from jaxpipe import _report


class _FakeCheckpointer:
  def __init__(self):
    self.saved, self.waits = [], 0

  def save(self, step, tree, data_state, meta):
    self.saved.append((step, tree, data_state, meta))

  def wait(self):
    self.waits += 1


def test_checkpoint_policy_saves_on_schedule_and_never_twice():
  ckpt = _FakeCheckpointer()
  state = {"v": 0}
  saves = _loop.CheckpointPolicy(ckpt, every=3, steps=9, saved_at=None,
                                 payload=lambda k: (dict(state), "data", {"step": k}))
  assert [k for k in range(1, 10) if saves.due(k)] == [3, 6]   # not 9: the end saves itself
  state["v"] = 1
  saves.save(3)
  saves.save(3, wait=True)            # a stop right after the periodic save: nothing new
  assert [s[0] for s in ckpt.saved] == [3] and ckpt.waits == 1
  assert ckpt.saved[0][1] == {"v": 1} and ckpt.saved[0][3] == {"step": 3}
  saves.save(9)
  assert [s[0] for s in ckpt.saved] == [3, 9]
  # A run resumed at its last checkpoint does not write it again.
  again = _loop.CheckpointPolicy(ckpt, every=0, steps=9, saved_at=9, payload=lambda k: ())
  again.save(9)
  assert len(ckpt.saved) == 2 and not any(again.due(k) for k in range(1, 10))


def test_signals_ask_to_stop_then_stop_now():
  before = signal.getsignal(signal.SIGTERM)
  with _loop.Signals() as signals:
    assert signals.stop is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.stop == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt) as second:
      os.kill(os.getpid(), signal.SIGINT)
    assert second.value.args == (signal.SIGINT,)  # the command exits 128 + it
  assert signal.getsignal(signal.SIGTERM) is before


class _FakeSchedule:
  num_stages, loss_lag = 2, 1

  def replicated(self):
    import jax  # pylint: disable=g-import-not-at-top
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _met(finite, stages=(True, True), shared=True):
  return {"finite": np.asarray(finite), "stage_finite": np.asarray(stages),
          "shared_finite": np.asarray(shared)}


def test_nonfinite_policy_stop_and_skip():
  stop = _loop.NonFinitePolicy("stop", _FakeSchedule())
  assert bool(stop.go)
  stop.dispatched({"finite": np.asarray(False)})
  assert not bool(stop.go)                    # the next step is queued to do nothing
  assert stop.observe(_met(True))
  assert not stop.observe(_met(False, stages=(True, False)))
  assert not stop.proceed(4, _met(False, stages=(True, False)))
  assert stop.stopped_at == (4, 3, "in the blocks of stage 1") and stop.skipped == 0
  skip = _loop.NonFinitePolicy("skip", _FakeSchedule())
  assert skip.go is None
  assert not skip.observe(_met(False, shared=False)) and skip.skipped == 1
  assert skip.proceed(5, _met(False, shared=False)) and skip.stopped_at is None
  assert _loop.where_nonfinite(_met(False), 2) == "in the loss"
  assert "embedding/head" in _loop.where_nonfinite(_met(False, shared=False), 2)


def test_evaluation_is_due_every_n_but_not_at_the_end():
  ev = _loop.Evaluation(None, [], every=4, steps=12)
  assert [k for k in range(1, 13) if ev.due(k)] == [4, 8]
  assert ev(None) is None                     # no validation batches: no loss
  assert not any(_loop.Evaluation(None, [], 0, 12).due(k) for k in range(1, 13))


def test_metrics_of_a_resumed_run_drop_what_it_will_redo(tmp_path):
  path = tmp_path / "metrics.jsonl"
  recs = [{"step": k, "loss": 1.0} for k in range(6)] + [
      {"step": 0, "val_loss": 2.0}, {"step": 4, "val_loss": 1.5}, {"step": 6, "val_loss": 1.4}]
  path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 7, "lo')
  log = _loop.Metrics(str(tmp_path), start_step=4, lag=1, enabled=True)
  log.write({"step": 3, "loss": float("nan")})
  log.close()
  kept = [json.loads(l) for l in path.read_text().splitlines()]
  # Batches 0-2 stay (batch 3 is reported again after step 4 with lag 1),
  # evaluations up to step 4 stay, the cut line goes; NaN is written as null.
  assert [r["step"] for r in kept if "loss" in r] == [0, 1, 2, 3]
  assert kept[-1] == {"step": 3, "loss": None}
  assert [r["step"] for r in kept if "val_loss" in r] == [0, 4] and log.val_steps == {0, 4}
  _loop.Metrics(str(tmp_path), start_step=0, lag=0, enabled=True).close()
  assert path.read_text() == ""               # a run that starts over rewrites everything


def test_the_loop_queues_step_k_plus_1_before_it_waits_for_step_k(tmp_path, monkeypatch):
  """No device work on the host's path: step k+1 is dispatched before anything reads step k.

  Each step's loss is gated by a callback that opens only once the next step
  has been dispatched. A loop that read step k (its metrics, or a device
  computation queued behind it, like a jitted learning rate) before
  dispatching step k+1 would wait for a gate that never opens.
  """
  import threading  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.experimental import io_callback  # pylint: disable=g-import-not-at-top

  from jaxpipe import config, trainer  # pylint: disable=g-import-not-at-top
  from tests import _runs  # pylint: disable=g-import-not-at-top
  steps = 5
  cfg = config.load(_runs.TINY, [f"run.dir={tmp_path / 'run'}", f"run.steps={steps}",
                                 f"data.cache_dir={tmp_path / 'cache'}", "eval.batches=0",
                                 "pipeline.microbatches=1"])
  gates = [threading.Event() for _ in range(steps)]
  timed_out = []
  events = []

  def wait_for(k, x):
    k = int(k)
    if not gates[k].wait(timeout=60):
      timed_out.append(k)
    events.append(("read", k))
    return x

  real_step = trainer.Schedule.step

  # XLA's CPU client runs a program holding a host callback inline, on the
  # dispatching thread, whenever its inputs are ready; only a gate whose input
  # is still being computed is queued. So every gate also takes the previous
  # gate's output (still closed when the next gate is dispatched) and the first
  # takes a long computation's, dispatched just before it. Both programs are
  # compiled before the loop starts: a compile between dispatching the long
  # computation and the first gate would give it time to finish, and the gate
  # would then block the only thread that could open it.
  def gated(k, loss, held):
    loss = loss + 0.0 * held  # nothing folds 0 * x in floating point
    return io_callback(wait_for, jax.ShapeDtypeStruct((), loss.dtype), k, loss, ordered=False)

  def long_computation(x):
    m = jnp.full((512, 512), x)
    return jnp.sum(jax.lax.fori_loop(0, 256, lambda _, a: jnp.tanh(a @ m), m)) * 0.0

  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  gated = jax.jit(gated).lower(jax.ShapeDtypeStruct((), jnp.int32), scalar, scalar).compile()
  long_computation = jax.jit(long_computation).lower(scalar).compile()
  held = []

  def step(self, state, tokens, targets, go=None):
    k = len([e for e in events if e[0] == "dispatch"])
    state, met = real_step(self, state, tokens, targets, go)
    events.append(("dispatch", k))
    if k < steps - 1:
      if not held:
        held.append(long_computation(met["loss"]))
      assert not timed_out, f"the loop waited for step(s) {timed_out} before queueing the next"
      assert not held[-1].is_ready(), "the gate's input was computed before the gate was queued"
      held.append(gated(jnp.int32(k), met["loss"], held[-1]))
      met = {**met, "loss": held[-1]}
    if k:
      gates[k - 1].set()  # step k is queued: step k-1 may be read now
    return state, met

  monkeypatch.setattr(trainer.Schedule, "step", step)
  summary = trainer.train(cfg)
  assert not timed_out, f"the loop waited for step(s) {timed_out} before queueing the next"
  order = [e for e in events if e[0] in ("dispatch", "read")]
  for k in range(steps - 1):
    assert order.index(("dispatch", k + 1)) < order.index(("read", k)), order
  assert summary["exit_code"] == 0 and summary["train_loss_step"] == steps - 1


def test_the_progress_line_counts_steps_one_way_and_shows_the_validation_loss(tmp_path):
  from jaxpipe import config  # pylint: disable=g-import-not-at-top
  cfg = config.load(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"),
                    [f"run.dir={tmp_path}", "run.steps=40", "pipeline.schedule=2bw",
                     "pipeline.stages=2"])
  progress = _report.Progress(cfg, 0, True, lambda k: 1e-3, _report.Throughput(cfg, None, 0))
  try:
    # 2bw reads step 39's metrics with the loss of step 38 (batch 37, counted from 0).
    assert progress.line(38, 37, 3.0, 0.1).startswith(
        "2bw step 39/40 | loss 3.0000 (of step 38) | lr 0.001")
    progress.validation(39, 2.5)  # the evaluation after step 39
    line = progress.line(38, 37, 3.0, 0.1)
    assert line.startswith("2bw step 39/40 | loss 3.0000 (of step 38) | val loss 2.5000 | lr")
    assert "val loss" not in progress.line(39, 38, 3.0, 0.1)  # only on its own step
  finally:
    progress.close()
