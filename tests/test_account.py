"""The CPU trace account (tools/cpu/account.py): a profiler trace read back per device, phase, collective, wait and gap.

A synthetic trace (the events XLA's CPU runtime writes, with made-up times)
checks the arithmetic exactly; a real trace of a small pipelined step checks
that the parts add up to the step the host measured.
"""

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tools.cpu import account

HLO = """
HloModule jit_step

%body (p: f32[4]) -> f32[4] {
  %fusion.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fc, metadata={op_name="jit(step)/shard_map/while/body/pipe_forward/mul"}
  %all-reduce.2 = f32[4]{0} all-reduce(%fusion.1), channel_id=1, replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(step)/pipe_head/psum"}
  %fusion.3 = f32[4]{0} fusion(%all-reduce.2), kind=kLoop, calls=%fc2, metadata={op_name="jit(step)/pipe_backward/transpose(jvp(pipe_forward/mul))"}
  ROOT %collective-permute.4 = f32[4]{0} collective-permute(%fusion.3), channel_id=2, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(step)/pipe_send/ppermute"}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %while.5 = f32[4]{0} while(%a), condition=%cond, body=%body
  ROOT %copy.6 = f32[4]{0} copy(%while.5)
}
"""


def _op(ts, dur, name, device, run, tid):
  return {"ph": "X", "ts": ts, "dur": dur, "name": name, "tid": tid,
          "args": {"device_ordinal": str(device), "hlo_op": name, "run_id": run}}


def test_hlo_ops_name_each_instructions_opcode_and_outermost_phase():
  ops = account.hlo_ops(HLO)
  assert ops["fusion.1"] == ("fusion", "forward")
  assert ops["all-reduce.2"] == ("all-reduce", "head")
  # A backward operation carries its forward's scope inside transpose(...).
  assert ops["fusion.3"] == ("fusion", "backward")
  assert ops["collective-permute.4"] == ("collective-permute", "send")
  assert ops["while.5"] == ("while", "other") and ops["copy.6"] == ("copy", "other")


def test_hlo_transfers_size_each_collective_and_name_a_permutes_senders():
  sizes = account.hlo_transfers(HLO)
  assert sizes == {"all-reduce.2": ("all-reduce", 16, None),
                   "collective-permute.4": ("collective-permute", 16, frozenset({0, 1}))}
  more = account.hlo_transfers("""
  %cp.1 = bf16[2,3]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,2}}
  %ar.2 = (f32[2,2]{1,0}, s32[]) all-reduce(%a, %b), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %cps.3 = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%y), channel_id=3, source_target_pairs={{2,0}}
  %cpd.4 = f32[8]{0} collective-permute-done(%cps.3)
  %ag.5 = pred[4]{0} all-gather(%p), channel_id=4, dimensions={0}
  %add.6 = f32[4]{0} add(%q, %q)
  %cps.7 = (u32[3]{0}, u32[3]{0}, u32[], u32[]) collective-permute-start(%z), channel_id=5, source_target_pairs={{0,1}}
  %ar.8 = (s4[6]{0}, f8e4m3fn[2]{0}, u32[]) all-reduce(%c, %d, %e), channel_id=6, to_apply=%add
""")
  assert more == {"cp.1": ("collective-permute", 12, frozenset({0, 1})),
                  "ar.2": ("all-reduce", 20, None),
                  # The asynchronous start's results alone; its done is not counted again.
                  "cps.3": ("collective-permute", 32, frozenset({2})),
                  "ag.5": ("all-gather", 4, None),
                  # u32 data is data: only the trailing contexts are dropped.
                  "cps.7": ("collective-permute", 12, frozenset({0})),
                  # Sub-byte and 8-bit floats by their width; a u32 scalar is 4 bytes.
                  "ar.8": ("all-reduce", 3 + 2 + 4, None)}


def test_account_adds_up_and_splits_collectives_into_moving_and_waiting():
  events = []
  # Step "a" (the first traced: only its end counts) and step "b", two devices.
  for d, tid in ((0, 10), (1, 20)):
    events.append(_op(0, 50, "copy.6", d, "a", tid))
  # Step b starts at 100 on device 0 and 110 on device 1 (the host gap is
  # 100 - 50 = 50 on both), and ends at 300.
  events += [
      _op(100, 200, "while.5", 0, "b", 10),            # a container: not counted itself
      _op(100, 40, "fusion.1", 0, "b", 10),
      _op(140, 30, "all-reduce.2", 0, "b", 10),        # 20 of it waiting
      {"ph": "X", "ts": 142, "dur": 20, "name": "Wait: pending_threads=1/2", "tid": 10},
      _op(170, 60, "fusion.3", 0, "b", 10),
      _op(250, 50, "collective-permute.4", 0, "b", 10),  # 230-250 idle before it
      _op(110, 60, "fusion.1", 1, "b", 20),
      _op(170, 10, "all-reduce.2", 1, "b", 20),
      _op(180, 100, "fusion.3", 1, "b", 20),
      _op(280, 20, "collective-permute.4", 1, "b", 20),
  ]
  result = account.account(events, HLO, completions=[0.0, 240e-6])
  [step] = result["steps"]
  assert step["span_us"] == 200 and step["host_gap_us"] == 50 and step["interval_us"] == 250
  assert step["measured_us"] == pytest.approx(240)
  dev0, dev1 = step["devices"][0], step["devices"][1]
  assert dev0 == {"forward": 40, "head collective": 10, "head wait": 20, "backward": 60,
                  "send collective": 50, "idle": 20, "host gap": 50}
  # Device 1 started 10 late: that is idle inside the step.
  assert dev1 == {"forward": 60, "head collective": 10, "backward": 100,
                  "send collective": 20, "idle": 10, "host gap": 50}
  for parts in (dev0, dev1):
    assert sum(parts.values()) == step["interval_us"]
  # Step b ran one all-reduce and one permute on each device, 16 bytes each;
  # the container and step a's copy are not collectives.
  once = {"count": 1, "bytes": 16}
  assert step["transfers"] == {0: {"all-reduce": once, "collective-permute": once},
                               1: {"all-reduce": once, "collective-permute": once}}
  summary = account.summarise(result)
  assert summary["transfers"][1]["collective-permute"] == {"count": 1.0, "bytes": 16.0}
  # Devices named by their place in the mesh: a permute from place 1 only
  # counts on the device at that place, whatever its ordinal in the trace.
  one_way = HLO.replace("source_target_pairs={{0,1},{1,0}}", "source_target_pairs={{1,0}}")
  swapped = account.account(events, one_way, partitions={0: 1, 1: 0})["steps"][0]["transfers"]
  assert "collective-permute" in swapped[0] and "collective-permute" not in swapped[1]
  plain = account.account(events, one_way)["steps"][0]["transfers"]
  assert "collective-permute" not in plain[0] and "collective-permute" in plain[1]
  assert summary["devices"][0]["backward"] == 60 and summary["interval_us"] == 250
  assert account.parts_in_order(dev0)[:2] == ["forward", "head collective"]
  assert account.parts_in_order(dev0)[-2:] == ["idle", "host gap"]


DOT_HLO = """
HloModule jit_step

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %dot.7 = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/pipe_backward/dot_general"}
  ROOT %fusion.8 = f32[4,4]{1,0} fusion(%dot.7), kind=kLoop, calls=%fc, metadata={op_name="jit(step)/pipe_backward/add"}
}
"""


def _end(ts, name, tid):
  return {"ph": "X", "ts": ts, "dur": 0.1, "name": f"end: {name}", "tid": tid, "args": {}}


def test_an_operation_lasts_until_the_runtime_marks_it_complete():
  """XLA's CPU dots finish on the intra-op pool after their event ends; the
  `end:` mark the runtime records then is the dot's end, not idle time."""
  events = [_op(0, 10, "fusion.8", 0, "a", 10), _op(0, 10, "fusion.8", 1, "a", 20)]
  events += [
      # Device 0: the dot's event covers 100-120, the pool finishes it at 150.
      _op(100, 20, "dot.7", 0, "b", 10), _end(150, "dot.7", 10),
      _op(160, 40, "fusion.8", 0, "b", 10), _end(199, "fusion.8", 10),
      # Device 1: its dot's mark lands on another thread (no start there).
      _op(100, 30, "dot.7", 1, "b", 20), _end(170, "dot.7", 30),
      _op(180, 20, "fusion.8", 1, "b", 20), _end(199, "fusion.8", 20),
  ]
  [step] = account.account(events, DOT_HLO)["steps"]
  dev0, dev1 = step["devices"][0], step["devices"][1]
  # 100-150 the dot, 150-160 idle, 160-200 the fusion; a mark before its
  # event's end (the fusion's, at 199) shortens nothing.
  assert dev0 == {"backward": 90, "idle": 10, "host gap": 90}
  assert dev1 == {"backward": 90, "idle": 10, "host gap": 90}
  # Without the marks the untraced rest of each dot would read as idle.
  plain = [e for e in events if not e["name"].startswith("end: ")]
  [before] = account.account(plain, DOT_HLO)["steps"]
  assert before["devices"][0]["idle"] == 40 and before["devices"][1]["idle"] == 50
  # The input events are left as they were.
  assert events[2]["dur"] == 20


def test_a_lost_mark_does_not_stretch_an_operation_into_a_later_step():
  """A start whose `end:` mark the trace lost is superseded by its device's
  next start of that operation, and no operation outlasts its own step."""
  events = [
      # Step a: device 0's dot has no mark; device 1's dot ends at its mark.
      _op(0, 10, "dot.7", 0, "a", 10), _op(0, 10, "dot.7", 1, "a", 20), _end(15, "dot.7", 20),
      _op(20, 10, "fusion.8", 0, "a", 10), _op(20, 10, "fusion.8", 1, "a", 20),
      # Step b: device 0 launches its dot on another thread; device 1's
      # mark lands on thread 10, where device 0's markless dot of step a
      # started, and must go to device 1's dot of step b.
      _op(100, 20, "dot.7", 0, "b", 40), _end(150, "dot.7", 40),
      _op(95, 25, "dot.7", 1, "b", 20), _end(140, "dot.7", 10),
      _op(160, 40, "fusion.8", 0, "b", 10), _op(160, 40, "fusion.8", 1, "b", 20),
      # A mark far past the step (a stale pairing would stretch into step c).
      _op(210, 5, "fusion.8", 0, "c", 10), _op(210, 5, "fusion.8", 1, "c", 20),
      _end(400, "fusion.8", 10),
  ]
  steps = account.account(events, DOT_HLO)["steps"]
  b, c = steps
  assert b["host_gap_us"] == 65 and b["span_us"] == 105
  assert b["devices"][0] == {"backward": 90, "idle": 15, "host gap": 65}
  assert b["devices"][1] == {"backward": 85, "idle": 20, "host gap": 65}
  # Step c's fusion keeps its event's length: its mark is past its step's end.
  assert c["host_gap_us"] == 10 and c["span_us"] == 5
  assert c["devices"][0] == {"backward": 5, "idle": 0, "host gap": 10}


def test_the_summary_is_the_mean_step_so_its_parts_add_up():
  """Medians taken part by part come from different steps and need not add up;
  the summary averages each part over the steps, which adds up to the mean
  interval, and puts the host's clock over the same steps beside it."""
  def step(interval, fwd, idle, measured):
    return {"interval_us": interval, "span_us": interval - 5, "host_gap_us": 5,
            "measured_us": measured,
            "devices": {0: {"forward": fwd, "idle": idle, "host gap": 5},
                        1: {"forward": fwd - 10, "idle": idle + 10, "host gap": 5}}}
  # The host woke late for the second step's completion and early for the third's.
  steps = [step(100, 90, 5, 100), step(120, 60, 55, 150), step(110, 100, 5, 80)]
  part_medians = sum(sorted(s["devices"][0][p] for s in steps)[1]
                     for p in ("forward", "idle", "host gap"))
  assert part_medians != statistics.median(s["interval_us"] for s in steps)  # would not add up
  summary = account.summarise({"steps": steps})
  assert summary["steps"] == 3
  assert summary["interval_us"] == pytest.approx(110)
  assert summary["median_interval_us"] == 110
  assert summary["measured_us"] == pytest.approx(110)   # the wake-ups cancel over the steps
  assert summary["devices"][0] == pytest.approx({"forward": 250 / 3, "idle": 65 / 3,
                                                 "host gap": 5})
  for d in (0, 1):
    assert sum(summary["devices"][d].values()) == pytest.approx(summary["interval_us"])
  # A step the host did not time leaves the host's figure unknown, not biased.
  del steps[0]["measured_us"]
  assert math.isnan(account.summarise({"steps": steps})["measured_us"])
  assert account.summarise({"steps": []})["steps"] == 0


def _compiled_step(schedule: str, m: int, **kw):
  """(compiled step, a function running it once) of a 2-stage schedule of the test model."""
  from tests import _pipeline_util as util  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh, make_schedule  # pylint: disable=g-import-not-at-top
  sch = make_schedule(schedule, util.stage_fns(), util.optimizer("adamw"), make_mesh(2, 1), m,
                      stash="residuals", **kw)
  state = [sch.init(jax.tree.map(jnp.asarray, util.initial_params()), (m, util.ROWS, util.SEQ))]
  tok, tgt = (jax.device_put(x, sch.batch_sharding()) for x in util.batches(m)[0])
  compiled = sch.lower_step(state[0], tok, tgt).compile()

  def step():
    state[0], met = compiled(state[0], tok, tgt)
    return met

  jax.block_until_ready(step())
  return compiled, step


def test_a_traced_pipelined_step_adds_up_to_the_measured_step(tmp_path):
  """A real trace of a 2-stage 1f1b step: the parts of each device sum to its interval,
  the named phases show up, and the trace's interval agrees with the host's clock.
  """
  compiled, step = _compiled_step("1f1b", 4)
  n = 16
  done = account.profile_steps(step, jax.block_until_ready, n, str(tmp_path))
  result = account.account(account.read_trace(str(tmp_path)), compiled.as_text(), done)
  assert len(result["steps"]) == n - 1
  for s in result["steps"]:
    assert sorted(s["devices"]) == [0, 1]
    assert s["interval_us"] > 0 and s["measured_us"] > 0
    for parts in s["devices"].values():
      assert sum(parts.values()) == pytest.approx(s["interval_us"], rel=1e-9)
      assert parts["forward"] > 0 and parts["backward"] > 0 and parts["head"] > 0
      assert parts.get("send collective", 0) + parts.get("send wait", 0) > 0
  med = np.median([s["interval_us"] for s in result["steps"]])
  assert med > 0
  summary = account.summarise(result)
  for parts in summary["devices"].values():
    assert sum(parts.values()) == pytest.approx(summary["interval_us"], rel=1e-9)
  assert summary["measured_us"] == pytest.approx(
      (done[-1] - done[0]) * 1e6 / len(result["steps"]), rel=1e-9)
  # The trace's clock and the host's agree over the run. One step's pair does not:
  # a ~6 ms step's host interval moves by the host's wake-up delay at either end
  # (a CI run saw 10.8 ms traced against 6.4 ms measured for one step on a busy
  # machine), but over the run those delays cancel except at its two ends.
  assert summary["interval_us"] == pytest.approx(summary["measured_us"], rel=0.5)


@pytest.mark.parametrize("schedule,v", [("2bw", 1), ("interleaved", 2)])
def test_a_traced_step_sends_what_its_ticks_send(tmp_path, schedule, v):
  """The bytes a real step's collective-permutes carry, counted from its trace.

  2bw's are the planner's transfers (`facts(...).transfers` activations
  forward and as many cotangents back, each one microbatch's activation):
  all its ticks are full. Interleaved, lockstep on a ring, sends in each of
  a device's forward and backward slots, filled or not: vM+S-1 of each per
  device (its ticks less the vS-1 backward-only ones), which is more than the
  planner's. (This pins what the engine sends today: an engine that stops
  sending from empty slots changes the interleaved expectation to the
  planner's.) Every device joins each all-reduce alike.
  """
  from tests import _pipeline_util as util  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import facts  # pylint: disable=g-import-not-at-top
  m, s = 4, 2
  compiled, step = _compiled_step(schedule, m, **({"virtual_stages": v} if v > 1 else {}))
  done = account.profile_steps(step, jax.block_until_ready, 4, str(tmp_path))
  result = account.account(account.read_trace(str(tmp_path)), compiled.as_text(), done)
  activation = util.ROWS * util.SEQ * util.CONFIG.dim * 4   # float32
  f = facts(schedule, s, m, v)
  if schedule == "2bw":
    want = 2 * f.transfers
  else:
    assert f.ticks == v * (m + s) + s - 2
    want = s * 2 * (f.ticks - (v * s - 1))
    assert want > 2 * f.transfers
  assert len(result["steps"]) == 3
  for st in result["steps"]:
    sent = sum(st["transfers"][d]["collective-permute"]["bytes"] for d in (0, 1))
    assert sent == want * activation
    assert st["transfers"][0]["all-reduce"] == st["transfers"][1]["all-reduce"]
  summary = account.summarise(result)
  assert sum(summary["transfers"][d]["collective-permute"]["bytes"]
             for d in (0, 1)) == want * activation


def test_partitions_name_each_device_by_its_place_in_the_mesh():
  devices = jax.devices()[:2]
  mesh = jax.sharding.Mesh(np.array(devices[::-1]), ("stage",))
  got = account.partitions_of(mesh)
  assert got[devices[1].id] == 0 and got[devices[0].id] == 1
  assert set(got.values()) == {0, 1}
