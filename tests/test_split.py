"""A stage's backward split into B and W (`jaxpipe.pipeline._split`).

What the split must do: B then W give the unsplit vjp's gradients (to
float32 rounding; they run the same operations), and nothing is computed
twice: the matmul FLOPs of XLA's compiled B and W add up to those of the
unsplit backward, W's are exactly the weight gradients' contractions, and
neither re-runs the forward. FLOPs are read from the compiled HLO with each
`while` body counted as many times as it runs (XLA's own `cost_analysis`
counts it once). A negative control shows the naive split (W a second vjp
keeping only the weights' gradient) fails the check.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe.model import _llama
from jaxpipe.model._config import ModelConfig, MoEConfig
from jaxpipe.pipeline._split import SplitStage, split_pullback

B, T, DIM, LAYERS = 4, 32, 64, 2

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
# %name = shape op(operands), attributes; a tuple's shape has spaces.
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")


def _dims(shape: str):
  m = re.match(r"^[a-z0-9]+\[([0-9,]*)\](\{[^}]*\})?$", shape)
  return None if m is None else [int(d) for d in m.group(1).split(",") if d]


def hlo_dot_flops(text: str) -> tuple[float, int]:
  """(matmul FLOPs, dot count) of a compiled HLO module, loops counted per iteration.

  A dot's FLOPs are 2 x its output's size x its contracted size. A `while`
  body counts its known trip count times; every other called computation
  (fusions, calls, conditional branches: an upper bound) once per call.
  """
  comps, shapes, entry = {}, {}, None
  current = None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m:
      current = comps.setdefault(m.group(1), [])
      if line.startswith("ENTRY"):
        entry = m.group(1)
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      name, shape, op, rest = m.groups()
      shapes[name] = _dims(shape)
      current.append((shapes[name], op, rest))
  memo = {}

  def cost(comp):
    if comp in memo:
      return memo[comp]
    flops, dots = 0.0, 0
    for out, op, rest in comps[comp]:
      if op == "convolution":
        raise NotImplementedError("convolutions are not counted")
      if op == "dot":
        lhs = shapes[re.match(r"%([^\s,)]+)", rest).group(1)]
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest).group(1)
        size = np.prod([lhs[int(d)] for d in contracting.split(",") if d])
        flops += 2.0 * np.prod(out) * size
        dots += 1
      times = 1
      if op == "while":
        n = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
        if n is None:
          raise ValueError("a while loop without a known trip count")
        times = int(n.group(1))
      for callee in re.findall(r"(?:calls|body|to_apply|branch_computations)=\{?%([^\s,}]+)",
                               rest):
        f, d = cost(callee)
        flops, dots = flops + times * f, dots + times * d
    memo[comp] = (flops, dots)
    return memo[comp]

  return cost(entry)
