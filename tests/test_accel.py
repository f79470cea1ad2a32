"""The accelerator path on a CPU: peaks by exact device kind and FLOP accounting."""

import dataclasses

from jaxpipe import accel, trainer
from jaxpipe.config import ModelConfig


def test_peaks_are_looked_up_by_exact_device_kind():
  assert accel.device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4   # SXM5
  assert accel.device_peak_tflops("NVIDIA H100 PCIe") == 756.5
  assert accel.device_peak_tflops("NVIDIA H100 NVL") == 835.5
  assert accel.device_peak_tflops("NVIDIA H200") == 989.4
  assert accel.device_peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
  assert accel.device_peak_tflops("NVIDIA A100 80GB PCIe") == 312.0
  assert accel.device_peak_tflops("NVIDIA B200") == 2250.0
  assert accel.device_peak_tflops("TPU v5 lite") == 197.0
  assert accel.device_peak_tflops("TPU v5") == 459.0
  # Case and spacing aside, nothing is guessed: an unknown part has no peak.
  assert accel.device_peak_tflops("  nvidia h100  pcie ") == 756.5
  assert accel.device_peak_tflops("NVIDIA H100") is None
  assert accel.device_peak_tflops("NVIDIA H100 PCIe MIG 1g.10gb") is None
  assert accel.device_peak_tflops("cpu") is None
  assert trainer.device_peak_tflops("NVIDIA H100 PCIe") == 756.5


# 2 blocks of width 32, 4 heads of 8, 2 kv heads, SwiGLU 96, T=128 (tests/test_model.py counts
# its forward by hand: weight matmuls 49,152 FLOPs a token, causal attention 16,384, the head
# 2 x 32 x vocab).
SMALL = ModelConfig(vocab_size=63, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


def test_step_flops_hand_count_plain():
  cfg = dataclasses.replace(SMALL, remat="dots")
  f = accel.step_flops(cfg, 128, schedule="none", attention="xla")
  head = 2 * 32 * 63                                           # 4,032
  assert f.model == 3 * (49_152 + 16_384 + head) == 208_704
  assert f.model_full == 3 * (49_152 + 32_768 + head) == 257_856
  # dots saves the weight matmuls' outputs but not attention's batched dots: their forward
  # runs again in the backward. XLA's attention keeps its probabilities: nothing else.
  assert f.hardware == 208_704 + 16_384


def test_step_flops_hand_count_pipelined_recomputation():
  cfg = dataclasses.replace(SMALL, remat="full", loss_chunk=16)
  f = accel.step_flops(cfg, 128, schedule="2bw", stash="inputs", stages=2, attention="blockwise")
  assert f.model == 208_704                                     # useful work does not change
  blocks = 49_152 + 16_384                                      # one forward of the blocks
  head = 2 * 32 * 64                                            # vocabulary padded to 2 x 32
  expected = (3 * (blocks + head)        # forward and backward as computed
              + 16_384 // 2              # blockwise's backward recomputes the scores
              + blocks                   # the input stash: the stage's forward again
              + blocks                   # remat full: each block's forward inside the backward
              + head)                    # the chunked head: logits again in the backward
  assert f.hardware == expected == 352_256
  residuals = accel.step_flops(cfg, 128, schedule="2bw", stash="residuals", stages=2,
                               attention="blockwise")
  assert f.hardware - residuals.hardware == blocks
