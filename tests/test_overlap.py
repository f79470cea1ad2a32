"""The engine's transfers placed for overlap (GPUs) train exactly as one device, on CPU meshes.

On a GPU mesh every schedule sends the activation as soon as the forward
made it and a backward's cotangent at the start of the next tick with a
backward (zb1: as soon as B made it), so that block compute hides the
transfers (`Engine(overlap=True)`); a CPU mesh keeps one exchange at the
end of the tick. Here the GPU placement is forced on the emulated CPU mesh
and each schedule is checked against its one-device reference, as the CPU
placement is in test_pipeline.py, test_interleaved.py and test_zb1.py
(float32, the same tolerances). The compiled GPU programs themselves are
read in test_gpu.py.
"""

import re

import pytest

from jaxpipe.pipeline import make_mesh, make_schedule

from tests import _pipeline_util as util
from tests._pipeline_util import assert_runs_match, run, stale_reference

# (schedule, (S, D, M), v, reference): S=2 where the CPU placement has its
# one exchange, S=4 where middle stages send both ways.
CASES = [
    ("2bw", (2, 1, 2), 1, "delayed"),
    ("2bw", (4, 2, 6), 1, "delayed"),
    ("1f1b", (4, 1, 4), 1, "none"),
    ("gpipe", (2, 2, 3), 1, "none"),
    ("pipedream", (4, 1, 4), 1, "stale"),
    ("interleaved", (2, 1, 4), 2, "none"),
    ("zb1", (4, 1, 4), 1, "none"),
]


def _reference(kind: str, shape) -> util.Run:
  s, _, m = shape
  if kind == "delayed":
    return run("none", 1, 1, m, "adamw", delay=1)
  if kind == "stale":
    return stale_reference(tuple(s - 1 - i for i in range(s)), m, "adamw")
  return run("none", 1, 1, m, "adamw")


@pytest.mark.parametrize("schedule,shape,v,reference", CASES,
                         ids=[f"{c}-{util.shape_id(x)}" for c, x, _, _ in CASES])
def test_transfers_placed_for_overlap_train_as_one_device(schedule, shape, v, reference):
  """Each schedule with the GPU placement of its transfers matches its one-device reference."""
  s, d, m = shape
  got = run(schedule, s, d, m, "adamw", virtual_stages=v, overlap_sends=True)
  assert_runs_match(got, _reference(reference, shape))


def _pairs(hlo: str) -> set[str]:
  """The source-target pair lists of a program's collective-permutes."""
  return set(re.findall(r"collective-permute(?:-start)?\(.*?source_target_pairs=(\{[^=]*?\}\})",
                        hlo))


def test_the_gpu_placement_is_another_program():
  """At S=2 the CPU placement exchanges both ways in one permute, the GPU one sends each way alone.

  So the match above is not that of one program with itself.
  """
  cpu = run("2bw", 2, 1, 2, "adamw")
  gpu = run("2bw", 2, 1, 2, "adamw", overlap_sends=True)
  assert _pairs(cpu.hlo) == {"{{0,1},{1,0}}"}
  assert _pairs(gpu.hlo) == {"{{0,1}}", "{{1,0}}"}


def test_the_placement_follows_the_mesh_devices():
  """Left unsaid, a schedule places its transfers for overlap on any mesh but a CPU one."""
  fns, opt = util.stage_fns(), util.optimizer("adamw")
  assert not make_schedule("2bw", fns, opt, make_mesh(2, 1), 2).engine.overlap
  assert make_schedule("2bw", fns, opt, make_mesh(2, 1), 2, overlap_sends=True).engine.overlap
  # One stage has no transfer to place.
  assert not make_schedule("1f1b", fns, opt, make_mesh(1, 1), 2,
                           overlap_sends=True).engine.overlap
