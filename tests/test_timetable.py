"""Tests for jaxpipe.pipeline's timetables: pure Python, no devices.

The engine executes `step_plan`, and `timetable` unrolls the same plan, so
these checks hold for what actually runs. Each property is checked against
the schedules of docs/schedules.md written out independently here (tick formulas, versions,
stash lifetimes, bubble fractions), not against the module's own helpers.
"""

import itertools

import numpy as np
import pytest

from jaxpipe.pipeline import (bubble_fraction, min_microbatches, step_plan, ticks_per_step,
                              timetable)

PIPELINED = ("gpipe", "1f1b", "2bw", "pipedream")

# (S, M) pairs: M below, at and above S, M not a multiple of S, and 2bw's
# minimum 2(S-1) itself.
SHAPES = [(1, 1), (1, 3), (2, 2), (2, 3), (2, 5), (3, 4), (3, 7), (4, 6), (4, 8), (4, 11),
          (5, 8)]


def _valid(schedule):
  """The SHAPES a schedule accepts."""
  return [(s, m) for s, m in SHAPES if m >= min_microbatches(schedule, s)]


def _events(tt):
  """Ticks of every forward and backward, by (stage, global microbatch).

  Returns (fwd, bwd): dicts {(stage, mb): [tick, ...]} over the whole
  timetable; a list longer than one means the schedule repeated work.
  """
  fwd, bwd = {}, {}
  for tick, row in enumerate(tt.cells):
    for stage, cell in enumerate(row):
      if cell.fwd is not None:
        fwd.setdefault((stage, cell.fwd), []).append(tick)
      if cell.bwd is not None:
        bwd.setdefault((stage, cell.bwd), []).append(tick)
  return fwd, bwd


def _idle_share(tt, step):
  """Idle share of one step's slots, counted from the cells.

  A 1f1b/2bw/pipedream tick offers each stage a forward and a backward slot;
  a gpipe tick is either a forward or a backward tick, so it offers one.
  """
  rows = tt.cells[step * tt.ticks_per_step:(step + 1) * tt.ticks_per_step]
  slots_per_cell = 1 if tt.schedule == "gpipe" else 2
  busy = sum((c.fwd is not None) + (c.bwd is not None) for row in rows for c in row)
  return 1.0 - busy / (slots_per_cell * len(rows) * tt.num_stages)


# --- 2bw ---------------------------------------------------------------------


@pytest.mark.parametrize("s,m", _valid("2bw"))
def test_2bw_cells_follow_the_tick_formulas(s, m):
  """Stage s at global tick t: forward of t-s, backward of t-2(S-1)+s."""
  steps = 3
  tt = timetable("2bw", s, m, steps)
  assert tt.ticks_per_step == m == ticks_per_step("2bw", s, m)
  assert tt.num_ticks == steps * m
  for t, row in enumerate(tt.cells):
    for stage, cell in enumerate(row):
      f, b = t - stage, t - 2 * (s - 1) + stage
      assert cell.fwd == (f if f >= 0 else None), (t, stage)
      assert cell.bwd == (b if b >= 0 else None), (t, stage)


@pytest.mark.parametrize("s,m", _valid("2bw"))
def test_2bw_steady_state_has_no_idle_slot(s, m):
  """Only step 0 fills the pipeline; from step 1 on every slot is busy."""
  tt = timetable("2bw", s, m, 3)
  for k in (1, 2):
    assert all(c.fwd is not None and c.bwd is not None
               for row in tt.cells[k * m:(k + 1) * m] for c in row)
    assert _idle_share(tt, k) == 0.0 == tt.idle_fraction(k)
  assert bubble_fraction("2bw", s, m) == 0.0
  # The fill: stage s idles s forward slots and 2(S-1)-s backward slots.
  assert _idle_share(tt, 0) == pytest.approx(2 * s * (s - 1) / (2 * m * s))


@pytest.mark.parametrize("s,m", _valid("2bw"))
def test_2bw_versions_and_batch_completion(s, m):
  """Batch k runs on v[k] everywhere; its backwards all end within step k+1.

  The last point is what makes `v[k+2] = v[k+1] + U(G[k])` at the end of
  step k+1 legal, and it needs M >= 2(S-1).
  """
  steps = 4
  tt = timetable("2bw", s, m, steps)
  fwd, bwd = _events(tt)
  for row in tt.cells:
    for c in row:
      if c.fwd is not None:
        assert c.fwd_version == c.fwd // m
      if c.bwd is not None:
        assert c.bwd_version == c.bwd // m
  for stage in range(s):
    for mb in range((steps - 1) * m):
      k = mb // m
      [tb] = bwd[(stage, mb)]
      assert tb < (k + 2) * m, (stage, mb)  # done before step k+1 ends
      assert tb >= k * m                    # and not before batch k started
  # Within the window M >= 2(S-1) is also sharp: the last microbatch of
  # batch k finishes on stage 0 at tick (k+1)M-1 + 2(S-1).
  last = m - 1
  assert bwd[(0, last)] == [last + 2 * (s - 1)]


# --- every tick-based schedule -----------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "pipedream"])
@pytest.mark.parametrize("s,m", SHAPES)
def test_microbatches_move_one_stage_per_tick(schedule, s, m):
  """Forwards go s -> s+1 and backwards s+1 -> s in consecutive ticks.

  Every microbatch is run once forward and once backward on each stage, its
  forward never after its backward (on the last stage they share a tick), and
  its input is stashed for exactly 2(S-1-s) ticks.
  """
  if m < min_microbatches(schedule, s):
    pytest.skip("below the schedule's minimum")
  steps = 3
  tt = timetable(schedule, s, m, steps)
  fwd, bwd = _events(tt)
  # 2bw's last batch is still in flight when the timetable ends.
  done = (steps - 1) * m if schedule == "2bw" else steps * m
  for mb in range(done):
    for stage in range(s):
      [tf], [tb] = fwd[(stage, mb)], bwd[(stage, mb)]
      assert tb - tf == 2 * (s - 1 - stage), (mb, stage)
      if stage + 1 < s:
        assert fwd[(stage + 1, mb)] == [tf + 1]
        assert bwd[(stage + 1, mb)] == [tb - 1]
  assert all(len(v) == 1 for v in fwd.values()) and all(len(v) == 1 for v in bwd.values())


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "pipedream"])
@pytest.mark.parametrize("s,m", SHAPES)
def test_stash_ring_of_2s_minus_1_slots_suffices(schedule, s, m):
  """Replays the engine's stash: write slot mb % R at the forward, read at the backward.

  R = 2(S-1)+1. In a tick the engine writes the forward's input before it
  reads the backward's (the last stage does both for one microbatch), and
  the read must find the microbatch it expects, never a newer one.
  """
  if m < min_microbatches(schedule, s):
    pytest.skip("below the schedule's minimum")
  ring = 2 * (s - 1) + 1
  tt = timetable(schedule, s, m, 3)
  for stage in range(s):
    slots = [None] * ring
    for row in tt.cells:
      c = row[stage]
      if c.fwd is not None:
        slots[c.fwd % ring] = c.fwd
      if c.bwd is not None:
        assert slots[c.bwd % ring] == c.bwd, (stage, c.bwd)


@pytest.mark.parametrize("s,m", _valid("pipedream"))
def test_pipedream_versions_lag_by_stage(s, m):
  """Batch k runs on stage s with version max(0, k-(S-1-s)), forward and backward.

  The last stage has no delay: it runs batch k on v[k], as synchronous
  training does; stage 0 lags by S-1 updates.
  """
  steps = s + 2
  tt = timetable("pipedream", s, m, steps)
  seen = set()
  for row in tt.cells:
    for stage, c in enumerate(row):
      for mb, ver in ((c.fwd, c.fwd_version), (c.bwd, c.bwd_version)):
        if mb is not None:
          k = mb // m
          assert ver == max(0, k - (s - 1 - stage)), (stage, mb)
          if stage == s - 1:
            assert ver == k
          seen.add((stage, k, ver))
  # Stage s keeps d_s + 1 versions alive: over k the lag reaches d_s exactly.
  for stage in range(s):
    assert (stage, steps - 1, steps - 1 - (s - 1 - stage)) in seen


# --- flushed schedules: bubbles ----------------------------------------------


@pytest.mark.parametrize("s,m", SHAPES)
def test_gpipe_bubble(s, m):
  """GPipe idles (S-1)/(M+S-1) of every step, counted from the cells."""
  tt = timetable("gpipe", s, m, 2)
  want = (s - 1) / (m + s - 1)
  assert bubble_fraction("gpipe", s, m) == pytest.approx(want)
  for k in range(2):
    assert _idle_share(tt, k) == pytest.approx(want)
    assert tt.idle_fraction(k) == pytest.approx(want)
  assert tt.ticks_per_step == 2 * (m + s - 1) == ticks_per_step("gpipe", s, m)


@pytest.mark.parametrize("s,m", SHAPES)
def test_gpipe_order(s, m):
  """Forward of f on stage s at tick f+s; the backward ticks run them in reverse.

  Each gpipe tick is a forward or a backward tick, never both, and the
  backward of a microbatch on stage s comes after its forward on every stage.
  """
  tt = timetable("gpipe", s, m, 1)
  fwd, bwd = _events(tt)
  n = m + s - 1
  for f, stage in itertools.product(range(m), range(s)):
    assert fwd[(stage, f)] == [f + stage]
    assert bwd[(stage, f)] == [2 * n - 1 - (f + stage)]
    assert bwd[(stage, f)][0] > max(fwd[(x, f)][0] for x in range(s))
  assert all(c.fwd is None or c.bwd is None for row in tt.cells for c in row)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
@pytest.mark.parametrize("s,m", SHAPES)
def test_1f1b_bubble(schedule, s, m):
  """Lockstep 1F1B idles 2(S-1)/(M+2(S-1)) of every step, counted from the cells."""
  tt = timetable(schedule, s, m, 2)
  want = 2 * (s - 1) / (m + 2 * (s - 1))
  assert bubble_fraction(schedule, s, m) == pytest.approx(want)
  for k in range(2):
    assert _idle_share(tt, k) == pytest.approx(want)
    assert tt.idle_fraction(k) == pytest.approx(want)
  assert tt.ticks_per_step == m + 2 * (s - 1) == ticks_per_step(schedule, s, m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("s,m", SHAPES)
def test_flushed_schedules_finish_each_batch_within_its_step(schedule, s, m):
  """A flush: every microbatch of batch k is run forward and backward in step k."""
  tt = timetable(schedule, s, m, 2)
  fwd, bwd = _events(tt)
  n = tt.ticks_per_step
  for mb, stage in itertools.product(range(2 * m), range(s)):
    k = mb // m
    for ticks in (fwd[(stage, mb)], bwd[(stage, mb)]):
      assert len(ticks) == 1 and k * n <= ticks[0] < (k + 1) * n


# --- plans, limits and rendering ---------------------------------------------


def test_step_plan_window_indices():
  """2bw's plan names window indices: below M is the previous batch, -1 is never used."""
  s, m = 3, 5
  plan = step_plan("2bw", s, m)
  assert plan.fwd.shape == plan.bwd.shape == (m, s)
  assert plan.fwd.dtype == plan.bwd.dtype == np.int32
  tick, stage = np.arange(m)[:, None], np.arange(s)[None, :]
  np.testing.assert_array_equal(plan.fwd, m + tick - stage)
  np.testing.assert_array_equal(plan.bwd, m + tick - 2 * (s - 1) + stage)
  assert plan.fwd.min() >= 0 and plan.bwd.min() >= 0 and plan.fwd.max() < 2 * m
  # Flushed plans only name this batch's microbatches (M..2M-1) or -1.
  for name in ("gpipe", "1f1b", "pipedream"):
    p = step_plan(name, s, m)
    used = np.concatenate([p.fwd.ravel(), p.bwd.ravel()])
    assert set(used.tolist()) == {-1} | set(range(m, 2 * m)), name
  assert step_plan("gpipe", s, m).backward_by_autodiff
  assert not step_plan("1f1b", s, m).backward_by_autodiff


@pytest.mark.parametrize("s", [2, 3, 4, 8])
def test_min_microbatches_is_enforced(s):
  """2bw needs M >= 2(S-1); the flushed schedules accept any M >= 1."""
  assert min_microbatches("2bw", s) == 2 * (s - 1)
  with pytest.raises(ValueError, match=rf"at least {2 * (s - 1)}"):
    step_plan("2bw", s, 2 * (s - 1) - 1)
  with pytest.raises(ValueError, match=rf"at least {2 * (s - 1)}"):
    timetable("2bw", s, 2 * (s - 1) - 1)
  step_plan("2bw", s, 2 * (s - 1))
  for name in ("gpipe", "1f1b", "pipedream"):
    assert min_microbatches(name, s) == 1
    step_plan(name, s, 1)


def test_unknown_schedule_has_no_plan():
  with pytest.raises(ValueError, match="no stage plan"):
    step_plan("none", 2, 2)
  with pytest.raises(ValueError, match="no stage plan"):
    step_plan("zero-bubble", 2, 2)


def test_none_timetable_is_one_stage_without_idle():
  tt = timetable("none", 1, 3, 2)
  assert tt.num_stages == 1 and tt.num_ticks == 6
  assert [row[0].fwd for row in tt.cells] == list(range(6))
  assert all(row[0].fwd == row[0].bwd for row in tt.cells)
  assert tt.idle_fraction(1) == 0.0 and bubble_fraction("none", 4, 3) == 0.0


def test_ascii_2bw():
  """The 2bw table of S=2, M=2 over two steps, cell by cell."""
  text = timetable("2bw", 2, 2, 2).ascii()
  rows = [line.split() for line in text.splitlines()]
  assert rows[0][0] == "2bw:"
  assert rows[1] == ["tick", "0", "1", "2", "3"]
  assert rows[2] == ["stage", "0", "F0v0/.", "F1v0/.", "F2v1/B0v0", "F3v1/B1v0"]
  assert rows[3] == ["stage", "1", "./.", "F0v0/B0v0", "F1v0/B1v0", "F2v1/B2v1"]
  assert text.splitlines()[4:] == ["step 0: idle 50.0% of slots",
                                   "step 1: idle 0.0% of slots"]


@pytest.mark.parametrize("schedule", PIPELINED + ("none",))
def test_ascii_renders_every_cell(schedule):
  """One row per stage, one column per tick, every slot drawn (idle as '.')."""
  s, m, steps = (1 if schedule == "none" else 3), 4, 2
  tt = timetable(schedule, s, m, steps)
  lines = tt.ascii().splitlines()
  assert len(lines) == 2 + s + steps
  assert lines[1].split()[1:] == [str(t) for t in range(tt.num_ticks)]
  for stage in range(s):
    cols = lines[2 + stage].split()[2:]
    assert len(cols) == tt.num_ticks
    for cell, text in zip((row[stage] for row in tt.cells), cols):
      if schedule == "gpipe":
        want = (f"F{cell.fwd}" if cell.fwd is not None
                else f"B{cell.bwd}" if cell.bwd is not None else ".")
        assert text == want
      else:
        f, b = text.split("/")
        assert f == ("." if cell.fwd is None else f"F{cell.fwd}" + (
            f"v{cell.fwd_version}" if schedule in ("2bw", "pipedream") else ""))
        assert b == ("." if cell.bwd is None else f"B{cell.bwd}" + (
            f"v{cell.bwd_version}" if schedule in ("2bw", "pipedream") else ""))
