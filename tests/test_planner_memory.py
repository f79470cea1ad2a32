"""The planner's memory estimate against XLA's analysis of the compiled step.

On the benchmark's small shapes (docs/benchmark.md: width 256, 8 blocks,
2 stages, 8 microbatches of 2 x 64 tokens), for every pipelined schedule
(interleaved with v = 2 chunks of 2 blocks per device; M is a multiple of
S) and both stash choices, the planner's total per device (`Estimate.total`, the sum of
the terms each schedule counts, `jaxpipe.pipeline._cost.memory_terms`) is
within 10% of XLA's resident bytes per device (arguments + outputs - aliased
+ temporaries) of the same step compiled on the emulated devices.
"""

from __future__ import annotations

import os

import pytest

from tests._runs import ROOT

SMALL = ["model.dim=256", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
         "data.seq_len=64", "data.batch_size=16", "pipeline.microbatches=8",
         "pipeline.stages=2", "pipeline.schedule=1f1b"]


@pytest.fixture(scope="module")
def small_plan():
  """The plan of the small shape (1f1b's config; interleaved planned with v = 2)."""
  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL)
  return planner.plan(cfg, work=False)


PIPELINED = ["gpipe", "1f1b", "2bw", "pipedream", "interleaved", "zb1"]


@pytest.mark.parametrize("schedule", PIPELINED)
@pytest.mark.parametrize("stash", ["inputs", "residuals"])
def test_estimate_within_10_percent_of_xla(small_plan, schedule, stash):
  """The planner's total per device is within 10% of XLA's resident bytes."""
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  xla = planner.compiled_memory(small_plan.cfg, schedule, stash)["resident"]
  estimate = small_plan.total(schedule, stash)
  assert abs(estimate / xla - 1) <= 0.10, (schedule, stash, estimate, xla)


def test_terms_sum_to_the_total_and_name_what_they_count(small_plan):
  """The total is state + step + the larger of a tick's working set and the update."""
  from jaxpipe.pipeline import PHASES  # pylint: disable=g-import-not-at-top
  for schedule in PIPELINED:
    for stash in ("inputs", "residuals"):
      terms = small_plan.terms[schedule][stash]
      keys = [t.key for t in terms]
      assert len(keys) == len(set(keys)) and all(t.label and t.nbytes >= 0 for t in terms)
      assert {t.phase for t in terms} <= set(PHASES)
      by = {p: sum(t.nbytes for t in terms if t.phase == p) for p in PHASES}
      assert small_plan.total(schedule, stash) == (by["state"] + by["step"]
                                                   + max(by["ticks"], by["update"]))
  # The residual stash keeps more per slot than the stage input: a check that can fail.
  assert small_plan.total("1f1b", "residuals") > small_plan.total("1f1b", "inputs")


def test_interleaved_counts_one_chunk(small_plan):
  """Interleaved (v = 2) counts a chunk: a weight slice per tick, half the stage's weight
  gradient, about half its residuals per slot; the other schedules slice nothing."""
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  assert small_plan.cfg.pipeline.schedule == "1f1b"
  assert planner.virtual_stages(small_plan.cfg, "interleaved") == 2
  by = small_plan.bytes
  for stash in ("inputs", "residuals"):
    assert by["interleaved"][stash]["chunk"] > 0
    assert by["1f1b"][stash]["chunk"] == 0
    # wgrad = the weight gradient (+ its float32 cast) + 2 activations of 2 rows x 64
    # tokens x 256 float32: interleaved's gradient is half of 1f1b's.
    act = 2 * 64 * 256 * 4
    assert 2 * by["interleaved"][stash]["wgrad"] - by["1f1b"][stash]["wgrad"] == 2 * act
  # A residual stash entry (read by the backward) is one chunk's: half the stage's.
  assert 2 * by["interleaved"]["residuals"]["read"] < 1.1 * by["1f1b"]["residuals"]["read"]
