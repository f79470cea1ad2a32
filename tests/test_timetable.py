"""Tests for jaxpipe.pipeline's timetables: pure Python, no devices.

The engine executes `step_plan`, and `timetable` unrolls the same plan, so
these checks hold for what actually runs. Each property is checked against
the schedules of docs/schedules.md written out independently here (tick
formulas, tick kinds and costs, versions, stash lifetimes, bubbles), not
against the module's own helpers.

Cost model, as the engine runs it: one stage's forward of one microbatch
takes 1, its backward 2, and a tick lasts as long as its slowest stage (3
for a tick in which some stage runs a forward and some stage a backward).
"""

import itertools

import numpy as np
import pytest

from jaxpipe.pipeline import facts, layer_order, min_microbatches, step_plan, timetable

PIPELINED = ("gpipe", "1f1b", "2bw", "pipedream")

# (S, M) pairs: M below, at and above S, M not a multiple of S, and 2bw's
# minimum 2(S-1) itself.
SHAPES = [(1, 1), (1, 3), (2, 2), (2, 3), (2, 5), (3, 4), (3, 7), (4, 6), (4, 8), (4, 11),
          (5, 8)]


def _valid(schedule):
  """The SHAPES a schedule accepts."""
  return [(s, m) for s, m in SHAPES if m >= min_microbatches(schedule, s)]


def _all_valid():
  """(schedule, S, M) for every pipelined schedule and every shape it accepts."""
  return [(name, s, m) for name in PIPELINED for s, m in _valid(name)]


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


def _ticks(schedule, s, m):
  """Ticks per step: gpipe M+S-1 forward then M+S-1 backward; 1f1b M+2(S-1); 2bw M."""
  return {"gpipe": 2 * (m + s - 1), "1f1b": m + 2 * (s - 1), "pipedream": m + 2 * (s - 1),
          "2bw": m}[schedule]


def _phase(schedule, s, m, t):
  """(any forward, any backward) in tick t of a step.

  1f1b and pipedream fill for S-1 forward-only ticks and drain for S-1
  backward-only ones, with M ticks of both between; gpipe runs M+S-1
  forward-only ticks, then M+S-1 backward-only; every 2bw tick has both
  (in the first step too: the engine runs the same step, with the previous
  batch's microbatches masked out).
  """
  if schedule == "2bw":
    return True, True
  if schedule == "gpipe":
    return (True, False) if t < m + s - 1 else (False, True)
  if t < s - 1:
    return True, False
  if t >= m + s - 1:
    return False, True
  return True, True


def _tick_cost(schedule, s, m, t):
  """Duration of tick t of a step: 1 for a forward, 2 for a backward, 3 for both."""
  f, b = _phase(schedule, s, m, t)
  return 1 * f + 2 * b


def _idle_share(tt, step):
  """Idle share of one step's stage time, counted from the cells.

  A stage is busy 1 for each forward and 2 for each backward it runs; the
  step lasts the sum of its tick costs, on each of the S stages.
  """
  n = tt.ticks_per_step
  rows = tt.cells[step * n:(step + 1) * n]
  busy = sum((c.fwd is not None) + 2 * (c.bwd is not None) for row in rows for c in row)
  duration = sum(_tick_cost(tt.schedule, tt.num_stages, tt.num_microbatches, t)
                 for t in range(n))
  return 1.0 - busy / (duration * tt.num_stages)


def _ring(schedule, s, m):
  """Stash slots per stage: gpipe keeps all M inputs, the tick schedules 2(S-1)+1."""
  return m if schedule == "gpipe" else 2 * (s - 1) + 1


# --- 2bw ---------------------------------------------------------------------


@pytest.mark.parametrize("s,m", _valid("2bw"))
def test_2bw_cells_follow_the_tick_formulas(s, m):
  """Stage s at global tick t: forward of t-s, backward of t-2(S-1)+s."""
  steps = 3
  tt = timetable("2bw", s, m, steps)
  assert tt.ticks_per_step == m == facts("2bw", s, m).ticks
  assert tt.num_ticks == steps * m
  for t, row in enumerate(tt.cells):
    for stage, cell in enumerate(row):
      f, b = t - stage, t - 2 * (s - 1) + stage
      assert cell.fwd == (f if f >= 0 else None), (t, stage)
      assert cell.bwd == (b if b >= 0 else None), (t, stage)


@pytest.mark.parametrize("s,m", _valid("2bw"))
def test_2bw_steady_state_has_no_idle_slot(s, m):
  """Only step 0 fills the pipeline; from step 1 on every stage is busy every tick."""
  tt = timetable("2bw", s, m, 3)
  for k in (1, 2):
    assert all(c.fwd is not None and c.bwd is not None
               for row in tt.cells[k * m:(k + 1) * m] for c in row)
    assert _idle_share(tt, k) == 0.0 == tt.idle_fraction(k)
  assert facts("2bw", s, m).bubble == 0.0
  # The fill: each of step 0's M ticks lasts 3 (the engine runs the whole
  # step, masking the missing batch), and stage s idles s forwards (1 each)
  # and 2(S-1)-s backwards (2 each): 4(S-1)-s. Over the stages that is
  # 7S(S-1)/2 of 3MS, i.e. 7(S-1)/(6M).
  want = 7 * (s - 1) / (6 * m)
  assert _idle_share(tt, 0) == pytest.approx(want)
  assert tt.idle_fraction(0) == pytest.approx(want)


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
  # 2bw never flushes: with more than one stage, some backward of batch 0
  # runs in step 1.
  if s > 1:
    assert any(bwd[(stage, mb)][0] >= m for stage in range(s) for mb in range(m))
  assert not facts("2bw", s, m).flushes


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


@pytest.mark.parametrize("schedule", PIPELINED)
@pytest.mark.parametrize("s,m", SHAPES)
def test_stash_ring_replay_with_the_drawn_slots(schedule, s, m):
  """Replays the engine's stash with the slots the cells name.

  2(S-1)+1 slots for 1f1b, 2bw and pipedream (M for gpipe). In a tick the
  engine writes the forward's input before it reads the backward's (the
  last stage does both for one microbatch), and the read must find the
  microbatch it expects, never a newer one. The ring is no larger than the
  replay needs: at some tick that many microbatches are alive on stage 0
  whenever the batch is long enough to fill it.
  """
  if m < min_microbatches(schedule, s):
    pytest.skip("below the schedule's minimum")
  ring = _ring(schedule, s, m)
  assert facts(schedule, s, m).stash_slots == ring == step_plan(schedule, s, m).slots
  tt = timetable(schedule, s, m, 3)
  peak = 0
  for stage in range(s):
    slots = [None] * ring
    alive = set()
    for row in tt.cells:
      c = row[stage]
      if c.fwd is not None:
        assert 0 <= c.fwd_slot < ring
        slots[c.fwd_slot] = c.fwd
        alive.add(c.fwd)
      peak = max(peak, len(alive))
      if c.bwd is not None:
        assert 0 <= c.bwd_slot < ring
        assert slots[c.bwd_slot] == c.bwd, (stage, c.bwd)
        alive.discard(c.bwd)
  assert peak <= ring
  # 2bw streams batches back to back; gpipe keeps all M; 1f1b and
  # pipedream fill 2(S-1)+1 slots once M reaches that.
  if schedule in ("2bw", "gpipe") or m >= ring:
    assert peak == ring


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


# --- tick kinds and the bubble -------------------------------------------------


@pytest.mark.parametrize("schedule,s,m", _all_valid())
def test_tick_kinds_and_costs(schedule, s, m):
  """1f1b/pipedream: S-1 forward-only ticks, M with both, S-1 backward-only.

  gpipe: M+S-1 forward-only ticks, then M+S-1 backward-only; 2bw: both in
  every tick. The segments the engine loops over cover the step in order,
  one kind each, and the cost of a tick follows from its kind.
  """
  plan = step_plan(schedule, s, m)
  n = _ticks(schedule, s, m)
  assert plan.num_ticks == n
  for t in range(n):
    k = plan.kind(t)
    assert (k.fwd, k.bwd) == _phase(schedule, s, m, t), t
  np.testing.assert_array_equal(plan.tick_costs(),
                                [_tick_cost(schedule, s, m, t) for t in range(n)])
  segments = plan.segments()
  assert segments[0][1] == 0 and segments[-1][2] == n
  for (a, _, end), (b, start, _) in zip(segments, segments[1:]):
    assert end == start and a != b
  for kind, t0, t1 in segments:
    assert t0 < t1 and all(plan.kind(t) == kind for t in range(t0, t1))
  # One version for every stage of a tick, except 2bw's fill and drain of
  # the previous batch, where stages run different batches.
  for t in range(n):
    k = plan.kind(t)
    if schedule == "2bw" and s > 1:
      # Stage s forwards window index M+t-s (the previous batch for t < s)
      # and backwards M+t-2(S-1)+s (the previous batch for t < 2(S-1)-s).
      assert k.fwd_version == (1 if t >= s - 1 else None), t
      assert k.bwd_version == (1 if t >= 2 * (s - 1) else 0 if t < s - 1 else None), t
    else:
      assert k.fwd_version == ((1 if schedule == "2bw" else 0) if k.fwd else None)
      assert k.bwd_version == ((1 if schedule == "2bw" else 0) if k.bwd else None)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("s,m", SHAPES)
def test_flushed_bubble(schedule, s, m):
  """GPipe, 1F1B and PipeDream idle (S-1)/(M+S-1) of every step's stage time.

  A step costs 3(M+S-1): gpipe's M+S-1 forward ticks (1 each) and as many
  backward ticks (2 each), 1f1b's S-1 fill ticks (1), M full ticks (3) and
  S-1 drain ticks (2); every stage is busy 3M of it.
  """
  tt = timetable(schedule, s, m, 2)
  want = (s - 1) / (m + s - 1)
  assert sum(tt.tick_costs[:tt.ticks_per_step]) == 3 * (m + s - 1)
  for k in range(2):
    assert _idle_share(tt, k) == pytest.approx(want)
    assert tt.idle_fraction(k) == pytest.approx(want)
  assert facts(schedule, s, m).bubble == pytest.approx(want)
  assert tt.ticks_per_step == _ticks(schedule, s, m)


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
  assert facts(schedule, s, m).flushes


# --- facts ---------------------------------------------------------------------


def _versions_kept(tt):
  """Most weight versions a stage must hold, counted from the cells.

  At step k a stage's newest weights are v[k] (k updates so far); it must
  also keep every older version its cells still run on in that step.
  """
  n, most = tt.ticks_per_step, 0
  for k in range(tt.num_steps):
    for stage in range(tt.num_stages):
      used = [v for row in tt.cells[k * n:(k + 1) * n]
              for v in (row[stage].fwd_version, row[stage].bwd_version) if v is not None]
      most = max(most, k - min(used) + 1)
  return most


@pytest.mark.parametrize("schedule,s,m", _all_valid())
def test_facts_agree_with_the_plan_and_the_cells(schedule, s, m):
  """ticks, step cost, bubble, stash slots, versions and minimum, each checked independently."""
  f = facts(schedule, s, m)
  plan = step_plan(schedule, s, m)
  tt = timetable(schedule, s, m, s + 1)
  n = _ticks(schedule, s, m)
  assert (f.schedule, f.num_stages, f.num_microbatches) == (schedule, s, m)
  assert f.ticks == n == plan.num_ticks == tt.ticks_per_step
  assert f.step_cost == float(plan.tick_costs().sum()) == sum(tt.tick_costs[:n])
  assert f.step_cost == (3 * m if schedule == "2bw" else 3 * (m + s - 1))
  assert f.bubble == pytest.approx(_idle_share(tt, tt.num_steps - 1))
  assert f.stash_slots == plan.slots == _ring(schedule, s, m)
  assert f.min_microbatches == (max(1, 2 * (s - 1)) if schedule == "2bw" else 1)
  assert f.flushes == (schedule != "2bw")
  kept = _versions_kept(tt)
  assert f.versions == {"gpipe": 1, "1f1b": 1, "2bw": 2, "pipedream": s}[schedule]
  if schedule == "2bw" and s == 1:
    # One stage finishes each microbatch in its tick: only v[k] is in use,
    # though the engine is still handed (v[k-1], v[k]).
    assert kept == 1 and plan.num_versions == 2
  else:
    assert kept == f.versions


def test_facts_of_none_and_bad_input():
  """The one-device step: M forwards and backwards of all S stages, no bubble."""
  f = facts("none", 4, 3)
  assert (f.ticks, f.bubble, f.versions, f.stash_slots, f.flushes) == (0, 0.0, 1, 0, True)
  assert f.step_cost == 3 * 3 * 4
  with pytest.raises(ValueError, match="unknown schedule"):
    facts("zero-bubble", 2, 2)
  with pytest.raises(ValueError, match="at least 6"):
    facts("2bw", 4, 5)


# --- the drawn cells are the executed arrays -----------------------------------


@pytest.mark.parametrize("schedule,s,m", _all_valid())
def test_plan_arrays_match_the_cells(schedule, s, m):
  """Every per-(tick, stage) and per-tick array of the plan, against the cells.

  Window index w of step k is global microbatch (k-1)M + w for 2bw (kM + w
  for the flushed schedules); its batch relative to the step (0: the
  previous one, 1: this one, for 2bw; 0 for the others) is the version
  index of the forward and the backward, and the accumulator the backward
  adds into. Pipedream gets one block version (the stage's own lagged
  weights) and two shared ones: 0 the embedding's, 1 the head's.
  """
  plan = step_plan(schedule, s, m)
  n, steps = plan.num_ticks, 3
  tt = timetable(schedule, s, m, steps)
  two = schedule == "2bw"
  assert (plan.window, plan.history) == ((2 * m, m) if two else (m, 0))
  assert plan.num_versions == plan.num_accumulators == (2 if two else 1)
  assert plan.num_shared_versions == (1 if schedule in ("gpipe", "1f1b") else 2)
  assert plan.slot_base_step == two and plan.head_stash == (schedule == "gpipe")

  def batch(w):  # the version / accumulator index of window index w
    return int(w >= m) if two else 0

  for k in range(steps):
    for t in range(n):
      row = tt.cells[k * n + t]
      for stage, c in enumerate(row):
        for w, mb, ver, pv, slot, ps in (
            (plan.fwd[t, stage], c.fwd, c.fwd_version, plan.fwd_version[t, stage], c.fwd_slot,
             plan.fwd_slot[t, stage]),
            (plan.bwd[t, stage], c.bwd, c.bwd_version, plan.bwd_version[t, stage], c.bwd_slot,
             plan.bwd_slot[t, stage])):
          if w < 0:
            assert mb is None and pv == -1 and ps == -1
            continue
          g = (k - 1) * m + w if two else k * m + w
          if g < 0:  # 2bw's first step: the previous batch does not exist
            assert two and k == 0 and mb is None
          else:
            assert mb == g
          assert pv == batch(w), (k, t, stage)
          if mb is not None:
            # The cell's version: 2bw's step k is given (v[k-1], v[k]);
            # pipedream's stage s its own v[max(0, k-(S-1-s))].
            want = (k - 1 + pv if two else
                    max(0, k - (s - 1 - stage)) if schedule == "pipedream" else k)
            assert ver == want
            # The slot: 2bw's ring is indexed by the global microbatch;
            # the flushed schedules restart at slot 0 every step.
            assert slot == (g if two else w) % plan.slots == (
                (k * m if two else 0) + ps) % plan.slots
        if plan.bwd[t, stage] >= 0:
          assert plan.acc[t, stage] == batch(plan.bwd[t, stage])
        else:
          assert plan.acc[t, stage] == -1
      # Per tick: stage 0's forward names the embedding, the last stage's
      # forward the head, stage 0's backward the embedding gradient.
      f0, fl, b0 = plan.fwd[t, 0], plan.fwd[t, -1], plan.bwd[t, 0]
      assert plan.embed_version[t] == (batch(f0) if f0 >= 0 else -1)
      head = 1 if schedule == "pipedream" else batch(fl)
      assert plan.head_version[t] == (head if fl >= 0 else -1)
      assert plan.head_acc[t] == (batch(fl) if fl >= 0 else -1)
      assert plan.embed_grad_version[t] == plan.embed_acc[t] == (batch(b0) if b0 >= 0 else -1)
      # The kind the engine specialises on is what the cells show (2bw's
      # first step masks the previous batch, so only later steps compare).
      if not (two and k == 0):
        kind = plan.kind(t)
        assert kind.fwd == any(c.fwd is not None for c in row)
        assert kind.bwd == any(c.bwd is not None for c in row)


# --- plans, limits and rendering ---------------------------------------------


def test_step_plan_window_indices():
  """2bw's plan names window indices: below M is the previous batch, -1 is never used."""
  s, m = 3, 5
  plan = step_plan("2bw", s, m)
  assert plan.fwd.shape == plan.bwd.shape == (m, s)
  for name in ("fwd", "bwd", "fwd_version", "bwd_version", "acc", "fwd_slot", "bwd_slot",
               "embed_version", "head_version", "head_acc", "embed_grad_version", "embed_acc"):
    assert getattr(plan, name).dtype == np.int32, name
    assert getattr(plan, name).shape[0] == m, name
  tick, stage = np.arange(m)[:, None], np.arange(s)[None, :]
  np.testing.assert_array_equal(plan.fwd, m + tick - stage)
  np.testing.assert_array_equal(plan.bwd, m + tick - 2 * (s - 1) + stage)
  assert plan.fwd.min() >= 0 and plan.bwd.min() >= 0 and plan.fwd.max() < 2 * m
  # Flushed plans only name this batch's microbatches (0..M-1) or -1.
  for name in ("gpipe", "1f1b", "pipedream"):
    p = step_plan(name, s, m)
    used = np.concatenate([p.fwd.ravel(), p.bwd.ravel()])
    assert set(used.tolist()) == {-1} | set(range(m)), name


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
  assert tt.idle_fraction(1) == 0.0 and facts("none", 4, 3).bubble == 0.0


def test_ascii_2bw():
  """The 2bw table of S=2, M=2 over two steps, cell by cell.

  Tick 0 has no backward on any stage, so its column has no backward half.
  Step 0 lasts 2 ticks of 3 on 2 stages (12); stage 0 runs 2 forwards,
  stage 1 one forward and one backward: 5 busy, 58.3% idle.
  """
  text = timetable("2bw", 2, 2, 2).ascii()
  rows = [line.split() for line in text.splitlines()]
  assert rows[0][0] == "2bw:"
  assert rows[1] == ["tick", "0", "1", "2", "3"]
  assert rows[2] == ["stage", "0", "F0v0", "F1v0/.", "F2v1/B0v0", "F3v1/B1v0"]
  assert rows[3] == ["stage", "1", ".", "F0v0/B0v0", "F1v0/B1v0", "F2v1/B2v1"]
  assert text.splitlines()[4:] == ["step 0: idle 58.3% of stage time",
                                   "step 1: idle 0.0% of stage time"]


def test_ascii_1f1b():
  """The 1f1b table of S=2, M=2: a forward-only fill tick and a backward-only drain tick.

  The step costs 1 + 3 + 3 + 2 = 9 on 2 stages (18), of which 3M per stage
  (12) is busy: idle 1/3 = (S-1)/(M+S-1).
  """
  text = timetable("1f1b", 2, 2, 1).ascii()
  rows = [line.split() for line in text.splitlines()]
  assert rows[0] == ["1f1b:", "S=2", "M=2,", "4", "ticks", "per", "step,", "1", "steps"]
  assert rows[2] == ["stage", "0", "F0", "F1/.", "./B0", "B1"]
  assert rows[3] == ["stage", "1", ".", "F0/B0", "F1/B1", "."]
  assert text.splitlines()[4:] == ["step 0: idle 33.3% of stage time"]


@pytest.mark.parametrize("schedule", PIPELINED + ("none",))
def test_ascii_renders_every_cell(schedule):
  """One row per stage, one column per tick, every slot drawn (idle as '.').

  A column keeps its forward half only if some stage runs a forward in that
  tick, its backward half only if some stage runs a backward.
  """
  s, m, steps = (1 if schedule == "none" else 3), 4, 2
  tt = timetable(schedule, s, m, steps)
  lines = tt.ascii().splitlines()
  assert len(lines) == 2 + s + steps
  assert lines[1].split()[1:] == [str(t) for t in range(tt.num_ticks)]
  tagged = schedule in ("2bw", "pipedream")

  def part(kind, mb, ver):
    return "." if mb is None else f"{kind}{mb}" + (f"v{ver}" if tagged else "")

  for stage in range(s):
    cols = lines[2 + stage].split()[2:]
    assert len(cols) == tt.num_ticks
    for row, text in zip(tt.cells, cols):
      cell = row[stage]
      any_f = any(c.fwd is not None for c in row)
      any_b = any(c.bwd is not None for c in row)
      want = ([part("F", cell.fwd, cell.fwd_version)] if any_f else []) + (
          [part("B", cell.bwd, cell.bwd_version)] if any_b else [])
      assert text == "/".join(want)
  if schedule == "gpipe":
    # A gpipe column is all forwards or all backwards: never a '/'.
    assert "/" not in "".join(lines[2:2 + s])


# --- interleaved 1F1B ------------------------------------------------------------

# (S, M, v): M a multiple of S (at S and above it), v from 2 to 4, one stage too.
INTERLEAVED = [(1, 1, 2), (1, 3, 3), (2, 2, 2), (2, 4, 2), (2, 6, 3), (2, 4, 4), (3, 3, 2),
               (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3)]


def _megatron(s, m, v):
  """Megatron's order on every device, written out: [(microbatch, chunk)] forward, backward.

  Groups of S microbatches; a group goes through chunk 0, then chunk 1, ...
  (forward), and back through chunk v-1 down to 0 (backward).
  """
  fwd = [(g * s + i, j) for g in range(m // s) for j in range(v) for i in range(s)]
  bwd = [(g * s + i, j) for g in range(m // s) for j in reversed(range(v)) for i in range(s)]
  return fwd, bwd


def _interleaved_events(tt):
  """{(stage, mb, chunk): [tick]} of the forwards and of the backwards."""
  fwd, bwd = {}, {}
  for tick, row in enumerate(tt.cells):
    for stage, c in enumerate(row):
      if c.fwd is not None:
        fwd.setdefault((stage, c.fwd, c.fwd_chunk), []).append(tick)
      if c.bwd is not None:
        bwd.setdefault((stage, c.bwd, c.bwd_chunk), []).append(tick)
  return fwd, bwd


@pytest.mark.parametrize("s,m,v", INTERLEAVED)
def test_interleaved_cells_are_megatrons_order_in_lockstep(s, m, v):
  """Stage s runs its k-th forward at tick k+s and its k-th backward at tick k+vS+S-2-s.

  A step has v(M+S)+S-2 ticks; every stage runs every (microbatch, chunk)
  once forward and once backward in it.
  """
  steps = 2
  tt = timetable("interleaved", s, m, steps, virtual_stages=v)
  n = v * (m + s) + s - 2
  assert tt.ticks_per_step == n == facts("interleaved", s, m, v).ticks
  fwd, bwd = _megatron(s, m, v)
  for k in range(steps):
    for t in range(n):
      for stage, c in enumerate(tt.cells[k * n + t]):
        i, j = t - stage, t - (v * s + s - 2) + stage
        want_f = (k * m + fwd[i][0], fwd[i][1]) if 0 <= i < m * v else (None, None)
        want_b = (k * m + bwd[j][0], bwd[j][1]) if 0 <= j < m * v else (None, None)
        assert (c.fwd, c.fwd_chunk) == want_f, (k, t, stage)
        assert (c.bwd, c.bwd_chunk) == want_b, (k, t, stage)
        assert c.fwd_version == (None if c.fwd is None else k)


@pytest.mark.parametrize("s,m,v", INTERLEAVED)
def test_interleaved_microbatches_go_round_the_ring_one_stage_per_tick(s, m, v):
  """Virtual stage g = j*S + s (chunk j of stage s): its forward of a microbatch is
  one tick after g-1's, its backward one tick after g+1's, across the ring's wrap
  (stage S-1's chunk j feeds stage 0's chunk j+1); the last one runs a microbatch's
  forward and backward in one tick, as 1f1b's last stage does."""
  tt = timetable("interleaved", s, m, 2, virtual_stages=v)
  fwd, bwd = _interleaved_events(tt)
  assert all(len(x) == 1 for x in fwd.values()) and all(len(x) == 1 for x in bwd.values())
  where = lambda g: (g % s, g // s)
  for mb in range(2 * m):
    for g in range(s * v):
      [tf], [tb] = fwd[(*where(g), mb)[:1] + (mb, where(g)[1])], bwd[(where(g)[0], mb,
                                                                     where(g)[1])]
      assert tf < tb or (g == s * v - 1 and tf == tb)
      if g + 1 < s * v:
        assert fwd[(where(g + 1)[0], mb, where(g + 1)[1])] == [tf + 1], (mb, g)
        assert bwd[(where(g + 1)[0], mb, where(g + 1)[1])] == [tb - 1], (mb, g)


@pytest.mark.parametrize("s,m,v", INTERLEAVED)
def test_interleaved_bubble_ticks_and_facts(s, m, v):
  """The bubble is (S-1)/(vM+S-1) under the cost model, counted from the cells.

  A tick runs one chunk, 1/v of a stage's blocks: it lasts 1/v of 1f1b's (a
  forward 1/v, a backward 2/v, both 3/v). vS-1 forward-only ticks, as many
  backward-only ones, vM-vS+S with both: a step lasts 3(vM+S-1)/v, of which
  every stage is busy 3M.
  """
  plan = step_plan("interleaved", s, m, v)
  f = facts("interleaved", s, m, v)
  n = v * (m + s) + s - 2
  phases = [(t <= m * v + s - 2, t >= v * s - 1) for t in range(n)]
  for t, (has_f, has_b) in enumerate(phases):
    kind = plan.kind(t)
    assert (kind.fwd, kind.bwd) == (has_f, has_b), t
  np.testing.assert_allclose(plan.tick_costs(), [(1 * a + 2 * b) / v for a, b in phases])
  assert f.step_cost == pytest.approx(3 * (v * m + s - 1) / v)
  want = (s - 1) / (v * m + s - 1)
  assert f.bubble == pytest.approx(want)
  tt = timetable("interleaved", s, m, 2, virtual_stages=v)
  busy = sum((c.fwd is not None) + 2 * (c.bwd is not None) for row in tt.cells[n:] for c in row)
  assert 1 - busy / v / (f.step_cost * s) == pytest.approx(want)
  assert tt.idle_fraction(1) == pytest.approx(want)
  # The kinds do not split the steady state by chunk (the head's and the
  # embedding's ticks come and go every S ticks): the loops the engine runs
  # do not grow with M (the edges of fill, steady state and drain), as in 1f1b.
  count = lambda mm: len(step_plan("interleaved", s, mm, v).segments())
  assert count(2 * m) == count(4 * m) <= 6
  # v times 1f1b's transfers (minus the last stage's own): M(vS-1), each way.
  assert f.transfers == m * (v * s - 1)
  assert (f.versions, f.gradient_delay, f.flushes, f.virtual_stages) == (1, "none", True, v)
  assert f.min_microbatches == s


@pytest.mark.parametrize("s,m,v", INTERLEAVED)
def test_interleaved_stash_replay_with_the_drawn_slots(s, m, v):
  """The engine's stash, replayed with the drawn slots: a read finds what was written.

  In a tick the forward's entry is written before the backward's is read.
  The plan keeps exactly as many slots as entries are alive at once, at most
  (v+1)S-1 (Megatron's warm-up of 2(S-1)+(v-1)S forwards, plus the one
  written before the first backward reads), and as many once M v reaches it.
  """
  plan = step_plan("interleaved", s, m, v)
  assert facts("interleaved", s, m, v).stash_slots == plan.slots
  tt = timetable("interleaved", s, m, 2, virtual_stages=v)
  peak = 0
  for stage in range(s):
    slots, alive = [None] * plan.slots, set()
    for row in tt.cells:
      c = row[stage]
      if c.fwd is not None:
        slots[c.fwd_slot] = (c.fwd, c.fwd_chunk)
        alive.add((c.fwd, c.fwd_chunk))
      peak = max(peak, len(alive))
      if c.bwd is not None:
        assert slots[c.bwd_slot] == (c.bwd, c.bwd_chunk), (stage, c.bwd, c.bwd_chunk)
        alive.discard((c.bwd, c.bwd_chunk))
  assert peak == plan.slots <= (v + 1) * s - 1
  if m * v >= (v + 1) * s - 1:
    assert plan.slots == (v + 1) * s - 1


@pytest.mark.parametrize("s,m,v", INTERLEAVED)
def test_interleaved_plan_arrays_match_the_cells(s, m, v):
  """The plan's arrays, against the cells: chunks, slots, and the per-tick shared entries.

  The embedding feeds stage 0's forwards of chunk 0, the head the last
  stage's forwards of chunk v-1, and the embedding's gradient stage 0's
  backwards of chunk 0; the kinds name what such a tick would use (version
  0, accumulator 0) wherever the stage has a forward (backward).
  """
  plan = step_plan("interleaved", s, m, v)
  tt = timetable("interleaved", s, m, 1, virtual_stages=v)
  assert (plan.window, plan.history, plan.num_versions, plan.num_shared_versions,
          plan.num_accumulators, plan.virtual_stages) == (m, 0, 1, 1, 1, v)
  assert not plan.slot_base_step and not plan.head_stash
  for t, row in enumerate(tt.cells):
    for stage, c in enumerate(row):
      assert plan.fwd[t, stage] == (-1 if c.fwd is None else c.fwd)
      assert plan.bwd[t, stage] == (-1 if c.bwd is None else c.bwd)
      assert plan.fwd_chunk[t, stage] == (-1 if c.fwd is None else c.fwd_chunk)
      assert plan.bwd_chunk[t, stage] == (-1 if c.bwd is None else c.bwd_chunk)
      assert plan.fwd_slot[t, stage] == (-1 if c.fwd is None else c.fwd_slot)
      assert plan.bwd_slot[t, stage] == (-1 if c.bwd is None else c.bwd_slot)
      assert plan.acc[t, stage] == (-1 if c.bwd is None else 0)
    first, last = row[0], row[-1]
    assert plan.embed_version[t] == (0 if first.fwd is not None and first.fwd_chunk == 0 else -1)
    assert plan.head_version[t] == plan.head_acc[t] == (
        0 if last.fwd is not None and last.fwd_chunk == v - 1 else -1)
    assert plan.embed_grad_version[t] == plan.embed_acc[t] == (
        0 if first.bwd is not None and first.bwd_chunk == 0 else -1)
    kind = plan.kind(t)
    assert kind.embed_version == (0 if first.fwd is not None else None)
    assert kind.head_version == kind.head_acc == (0 if last.fwd is not None else None)
    assert kind.embed_grad_version == kind.embed_acc == (0 if first.bwd is not None else None)


@pytest.mark.parametrize("s,m", [(1, 2), (2, 2), (2, 3), (4, 6)])
def test_interleaved_with_one_chunk_is_1f1b(s, m):
  """v = 1: the same ticks, microbatches, versions and shared entries as 1f1b."""
  a, b = step_plan("interleaved", s, m, 1), step_plan("1f1b", s, m)
  for name in ("fwd", "bwd", "fwd_version", "bwd_version", "acc", "embed_version",
               "head_version", "head_acc", "embed_grad_version", "embed_acc"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  assert facts("interleaved", s, m, 1).bubble == pytest.approx(facts("1f1b", s, m).bubble)


def test_layer_order_gives_each_device_its_chunks():
  """Device s's contiguous L/S positions hold chunks s, s+S, ..., s+(v-1)S in order."""
  for layers, s, v in ((8, 2, 2), (8, 4, 2), (8, 2, 4), (12, 3, 2), (6, 1, 3)):
    order = layer_order(layers, s, v)
    per = layers // (s * v)
    assert sorted(order.tolist()) == list(range(layers))
    for stage in range(s):
      mine = order[stage * v * per:(stage + 1) * v * per]
      want = [(j * s + stage) * per + i for j in range(v) for i in range(per)]
      assert mine.tolist() == want
  np.testing.assert_array_equal(layer_order(8, 4, 1), np.arange(8))
  with pytest.raises(ValueError, match="do not split"):
    layer_order(6, 2, 2)


def test_interleaved_refusals_and_ascii():
  """M not a multiple of S, v > 1 elsewhere and v < 1 are refused in one line."""
  with pytest.raises(ValueError, match="multiple of the 2 stages, got 3"):
    step_plan("interleaved", 2, 3, 2)
  with pytest.raises(ValueError, match="multiple of the 4 stages"):
    facts("interleaved", 4, 6, 2)
  with pytest.raises(ValueError, match="needs schedule interleaved"):
    step_plan("1f1b", 2, 2, 2)
  with pytest.raises(ValueError, match="needs schedule interleaved"):
    timetable("none", 1, 2, 1, virtual_stages=2)
  with pytest.raises(ValueError, match=">= 1"):
    facts("interleaved", 2, 2, 0)
  text = timetable("interleaved", 2, 2, 1, virtual_stages=2).ascii()
  rows = [line.split() for line in text.splitlines()]
  assert rows[0][:4] == ["interleaved:", "S=2", "M=2", "v=2,"]
  assert rows[2] == ["stage", "0", "F0c0", "F1c0", "F0c1", "F1c1/.", "./B0c1", "B1c1", "B0c0",
                     "B1c0"]
  assert rows[3] == ["stage", "1", ".", "F0c0", "F1c0", "F0c1/B0c1", "F1c1/B1c1", "B0c0",
                     "B1c0", "."]
  # 7.5 units on 2 stages, 6 busy each: (S-1)/(vM+S-1) = 1/5 idle.
  assert text.splitlines()[-1] == "step 0: idle 20.0% of stage time"
