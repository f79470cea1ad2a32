"""The GPU program, compiled here for H100 targets without a GPU, and read.

`jaxpipe.gpu` compiles the config's own step through jaxlib's CUDA plugin
(jaxpipe's `cuda` extra, which the README's test command installs) for
compile-only GPU devices, while this process's JAX runs on the CPU. For the
tiny config in bfloat16 on 2 H100s, in every pipelined schedule: it
compiles, it fits, attention is cuDNN's fused kernel, the matmuls run in
bfloat16, no buffer holds more than the stage's share of the blocks, and the
transfers of the steady ticks (a forward and a backward each) are
asynchronous with block compute scheduled between their start and done.
gpipe has no such tick: a forward-only (backward-only) tick's stage waits
for the value its neighbour sends, so no compute of the tick can hide it;
its transfers are asynchronous, and that is all that is asserted.
"""

import math
import os

import jax
import pytest

from jaxpipe import config as config_lib
from jaxpipe import gpu
from jaxpipe import hlo
from jaxpipe import trainer
from jaxpipe.cli import planner

from tests import _runs

needs_plugin = pytest.mark.skipif(
    gpu.cuda_plugin_missing() is not None,
    reason="jaxlib's CUDA plugin is not installed (jaxpipe's cuda extra; the README's test "
           "command installs it)")

SCHEDULES = ("2bw", "1f1b", "gpipe", "pipedream", "interleaved", "zb1")
SMOLLM_135M = os.path.join(_runs.ROOT, "configs", "smollm-135m.yaml")


def tiny(schedule: str, *overrides: str) -> config_lib.Config:
  """The tiny config in bfloat16 on 2 stages, 4 microbatches (interleaved: 2 chunks a stage)."""
  extra = ("pipeline.virtual_stages=2",) if schedule == "interleaved" else ()
  cfg = config_lib.load(_runs.TINY, [f"pipeline.schedule={schedule}", "pipeline.stages=2",
                                     "pipeline.microbatches=4", "model.compute_dtype=bfloat16",
                                     *extra, *overrides])
  return planner.resolve_vocab(cfg)


def test_every_target_file_states_its_figures():
  """Each kind's target file names its device and gives memory, bandwidth and a known peak."""
  assert set(gpu.KINDS) == {"h100", "h100-pcie", "h200", "a100", "b200"}
  for kind in gpu.KINDS.values():
    assert kind.device_kind.startswith("NVIDIA ")
    assert 40e9 <= kind.memory_bytes <= 200e9
    assert 1e12 <= kind.memory_bandwidth <= 10e12
    assert 300 <= kind.peak_tflops <= 2500 and kind.link_gbps > 0
  assert gpu.kind("h200").memory_bytes > gpu.kind("h100").memory_bytes
  with pytest.raises(ValueError, match="known: h100"):
    gpu.kind("v100")


@needs_plugin
@pytest.mark.parametrize("name", sorted(gpu.KINDS))
def test_xla_takes_every_target(name):
  """XLA's CUDA plugin parses each target (with this install's cuDNN and CUDA) into devices."""
  kind = gpu.kind(name)
  devices = gpu.topology_devices(kind, 2, 4)
  assert len(devices) == 8 and {d.device_kind for d in devices} == {kind.device_kind}
  assert [d.process_index for d in devices] == [0] * 4 + [1] * 4  # a node is a process
  assert "dnn_version_info" in gpu.target_text(kind)


def _steady(report: gpu.GpuReport) -> list[gpu.Transfer]:
  """The stage-to-stage sends inside the tick loops whose ticks hold a forward and a backward."""
  return [t for t in report.transfers
          if t.phase == "send" and t.in_loop and t.ticks and {"f", "b"} <= set(t.ticks)]


def _stacked_block_shapes(cfg: config_lib.Config) -> set[tuple[int, ...]]:
  """The shapes of the model's stacked block leaves: [n_layers, ...] each."""
  model, _, _ = trainer.components(cfg)
  params = jax.eval_shape(model.init, jax.random.key(0))
  return {tuple(x.shape) for x in jax.tree.leaves(params["blocks"])}


@needs_plugin
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_tiny_config_on_two_h100s(schedule):
  cfg = tiny(schedule)
  assert jax.default_backend() == "cpu"   # this process runs on the CPU
  step = gpu.compile_step(cfg, "h100")
  r = gpu.report(step)
  assert r.devices == 2 and r.nodes == 1 and r.device_kind == "NVIDIA H100 80GB HBM3"
  assert 0 < r.memory["resident"] and r.fits
  # The attention choice follows the devices compiled for, not this process's backend.
  assert r.attention["implementation"] == "cudnn"
  assert r.attention["kernels"].get("__cudnn$fmhaSoftmax", 0) >= 1
  assert r.attention["kernels"].get("__cudnn$fmhaSoftmaxBackward", 0) >= 1
  # Every matmul in the compute dtype (the head's backward included); AdamW has none of its own.
  assert set(r.cost.matmul_flops) == {"bf16"} and r.cost.block_flops > 0
  # No buffer holds a whole stack of blocks: each stage holds, and sums the gradients of, its own.
  shapes = {dims for _, ins in hlo.Module.parse(step.compiled.as_text()).walk(into_fusions=True)
            for _, dims in hlo.arrays(ins.shape)}
  stacked = _stacked_block_shapes(cfg)
  assert not shapes & stacked, shapes & stacked
  assert {(s[0] // 2,) + s[1:] for s in stacked} <= shapes
  transfers = [t for t in r.transfers if t.phase == "send"]
  assert transfers and all(t.asynchronous for t in transfers)
  steady = _steady(r)
  if schedule == "gpipe":
    assert not steady and {t.ticks for t in transfers if t.in_loop} == {"f", "b"}
    return
  assert steady
  for t in steady:
    assert t.hidden_block_flops > 0, t


def test_block_flops_of_a_microbatch():
  """The yardstick of the next test: one block's forward and backward matmuls on a microbatch."""
  cfg = planner.resolve_vocab(config_lib.load(SMOLLM_135M, []))
  per_device_tokens = cfg.data.batch_size // cfg.pipeline.microbatches // cfg.mesh.data \
      * cfg.data.seq_len
  flops = _one_block_flops(cfg)
  # 3.54M matmul weights a block (q, k, v, o and the MLP) and causal attention, x3 for the backward.
  assert flops == pytest.approx(per_device_tokens * 3 * (2 * 3.54e6 + 2 * 576 * 2048), rel=0.01)


def _one_block_flops(cfg: config_lib.Config) -> float:
  from jaxpipe.model import token_flops  # pylint: disable=g-import-not-at-top
  f = token_flops(cfg.model, cfg.data.seq_len)
  tokens = cfg.data.batch_size // cfg.pipeline.microbatches // cfg.mesh.data * cfg.data.seq_len
  return 3 * (f.dense + f.attention) / cfg.model.n_layers * tokens


@needs_plugin
def test_2bw_smollm_135m_hides_its_transfers_behind_a_block_of_matmuls():
  """The shipped SmolLM-135M 2bw step on 2 H100s: each steady tick's transfer has at least one
  block's forward and backward matmul FLOPs scheduled between its start and done."""
  cfg = planner.resolve_vocab(config_lib.load(SMOLLM_135M, []))
  r = gpu.report(gpu.compile_step(cfg, "h100"))
  steady = _steady(r)
  assert {t.kind for t in steady} == {"collective-permute"} and len(steady) == 2
  block = _one_block_flops(cfg)
  for t in steady:
    assert t.asynchronous and t.hidden_flops >= block, (t, block)
    assert t.exposed_s == 0.0
  assert r.fits and r.attention["implementation"] == "cudnn"
  assert r.cost.matmul_flops["f32"] < 0.01 * r.cost.matmul_flops["bf16"]  # the optimizer's only
  assert 0 < r.projected_mfu < 1 and math.isfinite(r.projected_step_s)
