"""Reading a compiled program's HLO text, and the GPU projection's arithmetic, on known programs.

The programs here are written by hand in the text XLA prints for a
scheduled GPU module (loops with known trip counts, a conditional, async
collectives, a Triton GEMM fusion, a cuBLAS call, a cuDNN attention call),
so every number the reader gives can be worked out on paper. The real GPU
programs are read in test_gpu.py.
"""

import json

import pytest

from jaxpipe import hlo
from jaxpipe.gpu import _read

# A step of two devices: a loop of 3 ticks, each a GEMM fusion [64,32] x
# [32,16] and a permute started before it and done after it; then a
# synchronous all-reduce, a conditional with a cheap and a dear branch, a
# cuBLAS GEMM and a cuDNN attention.
PROGRAM = """HloModule jit_step, is_scheduled=true

%gemm_computation (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (param: (s32[], bf16[64,32], bf16[32,16], bf16[64,16])) -> (s32[], bf16[64,32], bf16[32,16], bf16[64,16]) {
  %param = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[64,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%param), index=1
  %w = bf16[32,16]{1,0} get-tuple-element(%param), index=2
  %y = bf16[64,16]{1,0} get-tuple-element(%param), index=3
  %collective-permute-start = (bf16[64,16]{1,0}, bf16[64,16]{1,0}) collective-permute-start(%y), channel_id=1, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(step)/shard_map/ticks_fb/while/body/pipe_send/ppermute"}
  %gemm_fusion = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_computation, metadata={op_name="jit(step)/shard_map/ticks_fb/while/body/pipe_backward/dot_general"}
  %collective-permute-done = bf16[64,16]{1,0} collective-permute-done(%collective-permute-start)
  ROOT %t = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[64,16]{1,0}) tuple(%i, %x, %w, %gemm_fusion)
}

%cond (param.1: (s32[], bf16[64,32], bf16[32,16], bf16[64,16])) -> pred[] {
  %param.1 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[64,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%cheap (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%a)
}

%dear (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%b)
  ROOT %l = f32[4]{0} log(%e)
}

%add (l: f32[], r: f32[]) -> f32[] {
  %l = f32[] parameter(0)
  %r = f32[] parameter(1)
  ROOT %s = f32[] add(%l, %r)
}

ENTRY %main (x.1: bf16[64,32], w.1: bf16[32,16], v: f32[4], q: bf16[2,128,4,64], k: bf16[2,128,2,64], s: s32[]) -> f32[4] {
  %x.1 = bf16[64,32]{1,0} parameter(0)
  %w.1 = bf16[32,16]{1,0} parameter(1)
  %v = f32[4]{0} parameter(2)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(3)
  %k = bf16[2,128,2,64]{3,2,1,0} parameter(4)
  %s = s32[] parameter(5)
  %zero = bf16[64,16]{1,0} constant(0)
  %init = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[64,16]{1,0}) tuple(%s, %x.1, %w.1, %zero)
  %while = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[64,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %all-reduce = f32[4]{0} all-reduce(%v), channel_id=2, replica_groups=[1,2]<=[2], to_apply=%add
  %conditional = f32[4]{0} conditional(%s, %all-reduce, %all-reduce), branch_computations={%cheap, %dear}
  %cublas = (f32[64,16]{1,0}, s8[0]{0}) custom-call(%x.1, %w.1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %fmha = (bf16[2,4,128,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","4","128","128"]},"mask_type":"CAUSAL","bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"]}}}
  ROOT %out = f32[4]{0} copy(%conditional)
}
"""

# Round numbers for the arithmetic: 1 TFLOP/s, 1 GB/s of memory, 1 GB/s
# between two GPUs of a node, 0.5 GB/s across nodes.
LINKS = dict(peak_flops=1e12, memory_bandwidth=1e9, link_bandwidth=1e9, network_bandwidth=5e8)


def test_the_module_reads_computations_instructions_and_attributes():
  m = hlo.Module.parse(PROGRAM)
  assert m.entry_name == "main"
  assert [i.opcode for i in m.computations["body"].instructions] == [
      "parameter", "get-tuple-element", "get-tuple-element", "get-tuple-element",
      "get-tuple-element", "collective-permute-start", "fusion", "collective-permute-done",
      "tuple"]
  loop = m.entry.by_name["while"]
  assert loop.called == ["cond", "body"] and hlo.trip_count(loop) == 3
  assert m.entry.by_name["conditional"].called == ["cheap", "dear"]
  assert m.entry.root.name == "out"
  start = m.computations["body"].by_name["collective-permute-start"]
  assert start.operands == ("y",) and start.nbytes == 2 * 64 * 16 * 2
  assert hlo.shape_bytes("(f32[2,3]{1,0}, pred[5], s4[4], token[])") == 24 + 5 + 2


def test_matmul_flops_of_each_form():
  m = hlo.Module.parse(PROGRAM)
  body, entry = m.computations["body"], m.entry
  assert hlo.matmul_flops(m, body, body.by_name["gemm_fusion"]) == (2 * 64 * 16 * 32, "bf16")
  assert hlo.matmul_flops(m, entry, entry.by_name["cublas"]) == (2 * 64 * 16 * 32, "bf16")
  # Two products of [2 batches, 4 heads, 128, 128] scores over a 64-wide head, causal: halved.
  assert hlo.matmul_flops(m, entry, entry.by_name["fmha"]) == (2 * 2 * 2 * 4 * 128 * 128 * 64 / 2,
                                                             "bf16")
  assert hlo.matmul_flops(m, entry, entry.by_name["all-reduce"]) == (0.0, "")


@pytest.mark.parametrize("attrs,groups", [
    ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[4]", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}", [[0, 1], [2, 3]]),
    ("source_target_pairs={{0,1},{1,2}}", [[0, 1], [1, 2]]),
    ('frontend_attributes={_xla_send_recv_source_target_pairs={{1,0}}}', [[1, 0]]),
    ("replica_groups={}", []),
])
def test_collective_groups_in_every_notation(attrs, groups):
  ins = hlo.Module.parse(
      "ENTRY %e (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n"
      f"  ROOT %a = f32[4]{{0}} all-reduce(%p), {attrs}, to_apply=%add\n}}\n").entry.root
  assert hlo.collective_groups(ins) == groups


def test_the_projection_prices_kernels_loops_branches_and_transfers():
  m = hlo.Module.parse(PROGRAM)
  cost = _read.read_program(m, _read.Links(**LINKS, node_of=(0, 0)))
  gemm_bytes = (64 * 32 + 32 * 16 + 64 * 16) * 2
  gemm = max(2 * 64 * 16 * 32 / 1e12, gemm_bytes / 1e9) + _read.KERNEL_OVERHEAD_S
  permute = 64 * 16 * 2 / 1e9 + _read.LATENCY_S
  t = cost.transfers["collective-permute-start"]
  # Started before the GEMM and done after it: the GEMM hides that much of it.
  assert t.count == 3 and t.asynchronous and t.ticks == "fb" and t.phase == "send"
  assert t.hidden_flops == t.hidden_block_flops == 2 * 64 * 16 * 32
  assert t.hidden_s == pytest.approx(gemm)
  assert t.exposed_s == pytest.approx(max(0.0, permute - gemm))
  # The all-reduce: 2(n-1)/n of its 16 bytes at 1 GB/s plus the latency, all of it waited for.
  ar = cost.transfers["all-reduce"]
  assert not ar.asynchronous and ar.group_size == 2 and not ar.across_nodes
  assert ar.exposed_s == ar.seconds == pytest.approx(16 / 1e9 + _read.LATENCY_S)
  # The conditional costs its dear branch: two kernels of 32 bytes each.
  dear = 2 * (32 / 1e9 + _read.KERNEL_OVERHEAD_S)
  cublas = max(2 * 64 * 16 * 32 / 1e12,
               (64 * 32 * 2 + 32 * 16 * 2 + 64 * 16 * 4) / 1e9) + _read.KERNEL_OVERHEAD_S
  fmha_bytes = (2 * 128 * 4 * 64 + 2 * 2 * 128 * 2 * 64 + 2 * 4 * 128 * 64) * 2
  fmha = max(2 * 2 * 2 * 4 * 128 * 128 * 64 / 2 / 1e12, fmha_bytes / 1e9) + \
      _read.KERNEL_OVERHEAD_S
  copy = 2 * 16 / 1e9 + _read.KERNEL_OVERHEAD_S
  loop = 3 * (gemm + max(0.0, permute - gemm))
  assert cost.seconds == pytest.approx(loop + ar.seconds + dear + cublas + fmha + copy)
  assert cost.matmul_flops == {"bf16": 3 * 2 * 64 * 16 * 32 + 2 * 64 * 16 * 32
                               + 2 * 2 * 2 * 4 * 128 * 128 * 64 / 2}
  assert _read.attention_kernels(m) == {"__cudnn$fmhaSoftmax": 1}


def test_a_transfer_across_nodes_takes_the_network():
  m = hlo.Module.parse(PROGRAM)
  cost = _read.read_program(m, _read.Links(**LINKS, node_of=(0, 1)))
  t = cost.transfers["collective-permute-start"]
  assert t.across_nodes and t.seconds == pytest.approx(64 * 16 * 2 / 5e8
                                                       + _read.NETWORK_LATENCY_S)
  assert cost.transfers["all-reduce"].across_nodes
  assert json.dumps(t.as_json())  # what the planner prints
