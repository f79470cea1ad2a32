"""A compiled program read from its HLO text: computations, instructions, shapes, FLOPs.

`Module.parse(compiled.as_text())` turns XLA's text of a compiled (and, on
a GPU, scheduled) module into computations of instructions in their
program order, each with its result shape, opcode, operands and attributes.
On top of that: the bytes of a shape (`shape_bytes`), the arrays of a
shape (`arrays`), a `while` loop's trip count (`trip_count`), the
computations an instruction runs (`Instruction.called`), the FLOPs of a
matrix multiplication in any of the forms a GPU compile leaves it in (a
`dot`, a fusion whose computation holds one, a cuBLAS custom call, a cuDNN
fused attention: `matmul_flops`), and the device groups of a collective
(`collective_groups`).

Written by hand: JAX exposes a compiled program as text (and as a
serialized proto whose schema jaxlib does not ship), and no library reads
XLA's HLO text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Iterator, Optional

import numpy as np

__all__ = ["Instruction", "Computation", "Module", "arrays", "array_bytes", "shape_bytes",
           "dtype_bits",
           "trip_count", "matmul_flops", "collective_groups", "COLLECTIVE_KINDS"]

# Collectives by their synchronous opcode; asynchronous ones are `<kind>-start`
# and `<kind>-done` (or an `async-start` wrapping the kind).
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute", "collective-broadcast", "ragged-all-to-all")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_NAME = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
                     r"called_computations|branch_computations|async_execution_thread_computation"
                     r")=(\{[^}]*\}|%?[\w.\-]+)")


def dtype_bits(dtype: str) -> int:
  """Bits per element of an HLO element type: pred 8, the width its name carries (f8e4m3fn 8)."""
  if dtype == "pred":
    return 8
  m = re.match(r"[a-z]+(\d+)", dtype)
  return int(m.group(1)) if m else 0   # token[], opaque: no data


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, dimensions) of every array in a shape's text (a tuple's, in order)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
  """Bytes of one array: its elements at their width, rounded up (s4 packs two a byte)."""
  return -(-dtype_bits(dtype) * math.prod(dims) // 8)


def shape_bytes(shape: str) -> int:
  """Bytes of a shape (every array of a tuple), from its text."""
  return sum(array_bytes(t, dims) for t, dims in arrays(shape))


def _balanced(text: str, start: int, open_: str = "(", close: str = ")") -> int:
  """The index just past the bracket group that opens at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c == open_:
      depth += 1
    elif c == close:
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced {open_}{close} in HLO text: {text[start:start + 80]!r}")


def _split_top(text: str, sep: str = ",") -> list[str]:
  """`text` split at `sep` outside brackets, braces and quotes."""
  out, depth, quoted, cur = [], 0, False, []
  for c in text:
    if c == '"':
      quoted = not quoted
    elif not quoted:
      if c in "([{":
        depth += 1
      elif c in ")]}":
        depth -= 1
      elif c == sep and depth == 0:
        out.append("".join(cur).strip())
        cur = []
        continue
    cur.append(c)
  if "".join(cur).strip():
    out.append("".join(cur).strip())
  return out


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction.

  Attributes:
    name: its name, without the leading %.
    shape: its result type as written (`bf16[4,32]{1,0}`, a tuple in parentheses).
    opcode: e.g. `fusion`, `dot`, `while`, `collective-permute-start`.
    operands: the names of its operands (without %), in order; literal
      operands (a constant's value) are left out.
    attrs: everything after the operands, as written.
    root: whether it is its computation's ROOT.
  """
  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  root: bool = False

  def attr(self, key: str) -> Optional[str]:
    """The text of attribute `key=...` (a bracketed value whole), or None."""
    for part in _split_top(self.attrs):
      k, eq, v = part.partition("=")
      if eq and k.strip() == key:
        return v.strip()
    return None

  @property
  def called(self) -> list[str]:
    """Names of the computations it runs (a fusion's, a loop's body and condition, branches)."""
    out = []
    for _, value in _CALLED.findall(self.attrs):
      out += [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
    return out

  @property
  def backend_config(self) -> dict:
    """Its backend_config as a dict ({} where it has none or it is not JSON)."""
    text = self.attr("backend_config")
    if not text:
      return {}
    try:
      return json.loads(text)
    except ValueError:
      return {}

  @property
  def nbytes(self) -> int:
    """Bytes of its result."""
    return shape_bytes(self.shape)


@dataclasses.dataclass
class Computation:
  """A computation: its name, parameter shapes and instructions in program order."""
  name: str
  instructions: list[Instruction]
  entry: bool = False

  def __post_init__(self):
    self.by_name = {i.name: i for i in self.instructions}

  @property
  def root(self) -> Instruction:
    """Its ROOT instruction (the last one where none is marked)."""
    return next((i for i in self.instructions if i.root), self.instructions[-1])


def _parse_instruction(line: str) -> Optional[Instruction]:
  m = _NAME.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  paren = rest.find("(")
  if paren <= 0:
    return None
  opcode = rest[:paren].strip()
  end = _balanced(rest, paren)
  operand_text = rest[paren + 1:end - 1]
  operands = tuple(tok.split()[-1].lstrip("%") for tok in _split_top(operand_text)
                   if tok.split() and tok.split()[-1].startswith("%"))
  attrs = rest[end:].lstrip(", ")
  return Instruction(m.group(2), shape, opcode, operands, attrs, root=bool(m.group(1)))


@dataclasses.dataclass
class Module:
  """A module's computations by name, and the name of its entry computation."""
  computations: dict[str, Computation]
  entry_name: str

  @classmethod
  def parse(cls, text: str) -> "Module":
    """Reads the text of a module (`jax.stages.Compiled.as_text()`)."""
    comps, entry, current, body = {}, None, None, []
    for line in text.splitlines():
      if current is None:
        m = _HEADER.match(line)
        if m:
          current, body = (m.group(2), bool(m.group(1))), []
        continue
      if line.strip() == "}":
        name, is_entry = current
        comps[name] = Computation(name, body, is_entry)
        if is_entry:
          entry = name
        current = None
        continue
      ins = _parse_instruction(line)
      if ins is not None:
        body.append(ins)
    if entry is None:
      raise ValueError("HLO text without an ENTRY computation")
    return cls(comps, entry)

  @property
  def entry(self) -> Computation:
    """The entry computation."""
    return self.computations[self.entry_name]

  def walk(self, comp: Optional[Computation] = None, *,
           into_fusions: bool = False) -> Iterator[tuple[Computation, Instruction]]:
    """(computation, instruction) of every instruction reachable from `comp` (the entry).

    Control flow (loops, branches, calls, async wrappers) is followed; a
    fusion's computation only with `into_fusions`. Each computation is
    visited once.
    """
    seen = set()
    stack = [comp or self.entry]
    while stack:
      c = stack.pop()
      if c.name in seen:
        continue
      seen.add(c.name)
      for ins in c.instructions:
        yield c, ins
        if ins.opcode == "fusion" and not into_fusions:
          continue
        stack += [self.computations[n] for n in ins.called if n in self.computations]

  def shape_of(self, comp: Computation, name: str) -> str:
    """The result shape of instruction `name` of `comp` ('' where unknown)."""
    ins = comp.by_name.get(name)
    return ins.shape if ins is not None else ""


def trip_count(ins: Instruction) -> Optional[int]:
  """A `while` loop's trip count as XLA knows it (backend_config known_trip_count), else None."""
  n = ins.backend_config.get("known_trip_count", {}).get("n")
  return int(n) if n is not None else None


def _dims(value: Optional[str]) -> tuple[int, ...]:
  if not value:
    return ()
  return tuple(int(d) for d in value.strip("{}").split(",") if d.strip())


def _dot_flops(out_shape: str, lhs_shape: str, contracting: tuple[int, ...]) -> float:
  out = arrays(out_shape)
  lhs = arrays(lhs_shape)
  if not out or not lhs:
    return 0.0
  k = math.prod(lhs[0][1][d] for d in contracting) if contracting else 1
  return 2.0 * math.prod(out[0][1]) * k


def _fmha_flops(module: Module, comp: Computation, ins: Instruction) -> float:
  """FLOPs of a cuDNN fused attention call: its two (forward) or five (backward) matmuls.

  Each is a [batch, heads, seq_q, seq_k] product (the config's
  `intermediate_tensor_shape`) over one head's width (q's contracting
  dimension); a causal mask halves them.
  """
  cfg = ins.backend_config.get("cudnn_fmha_backend_config", {})
  scores = [int(d) for d in cfg.get("intermediate_tensor_shape", {}).get("dimensions", [])]
  q = arrays(module.shape_of(comp, ins.operands[0])) if ins.operands else []
  contracting = cfg.get("bmm1_dot_dimension_numbers", {}).get("lhs_contracting_dimensions")
  if not scores or not q or not contracting:
    return 0.0
  head = math.prod(q[0][1][int(d)] for d in contracting)
  causal = cfg.get("mask_type", "") in ("CAUSAL", "PADDING_CAUSAL")
  matmuls = 5 if "Backward" in (ins.attr("custom_call_target") or "") else 2
  return matmuls * 2.0 * math.prod(scores) * head * (0.5 if causal else 1.0)


def matmul_flops(module: Module, comp: Computation, ins: Instruction) -> tuple[float, str]:
  """(FLOPs, operand element type) of the matrix multiplications one run of `ins` does.

  A `dot` or `convolution`, a fusion whose computation holds dots (Triton's
  GEMM fusions, cuBLAS's epilogue fusions), a cuBLAS GEMM custom call
  (`__cublas$gemm`, `__cublas$lt$matmul`) and a cuDNN fused attention
  (`__cudnn$fmha*`) count; everything else is (0, ''). Loops and branches
  are not entered (`jaxpipe.gpu` weighs them by trips and branches).
  """
  if ins.opcode == "dot":
    lhs = module.shape_of(comp, ins.operands[0])
    flops = _dot_flops(ins.shape, lhs, _dims(ins.attr("lhs_contracting_dims")))
    return flops, (arrays(lhs)[0][0] if arrays(lhs) else "")
  if ins.opcode == "fusion":
    total, dtype = 0.0, ""
    for name in ins.called:
      sub = module.computations.get(name)
      if sub is None:
        continue
      for inner in sub.instructions:
        f, t = matmul_flops(module, sub, inner)
        if f:
          total, dtype = total + f, dtype or t
    return total, dtype
  if ins.opcode == "custom-call":
    target = (ins.attr("custom_call_target") or "").strip('"')
    if target.startswith("__cudnn$fmha"):
      q = module.shape_of(comp, ins.operands[0]) if ins.operands else ""
      return _fmha_flops(module, comp, ins), (arrays(q)[0][0] if arrays(q) else "")
    if target.startswith("__cublas"):
      cfg = ins.backend_config.get("gemm_backend_config", {})
      dims = cfg.get("dot_dimension_numbers", {})
      lhs = module.shape_of(comp, ins.operands[0]) if ins.operands else ""
      out = arrays(ins.shape)
      out_shape = f"{out[0][0]}[{','.join(map(str, out[0][1]))}]" if out else ""
      flops = _dot_flops(out_shape, lhs,
                         tuple(int(x) for x in dims.get("lhs_contracting_dimensions", [])))
      return flops, (arrays(lhs)[0][0] if arrays(lhs) else "")
  return 0.0, ""


def _iota_groups(spec: str) -> Optional[np.ndarray]:
  """Groups of an iota list `[G,N]<=[dims]T(perm)` (None where `spec` is not one)."""
  m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
  if not m:
    return None
  shape = _dims(m.group(1))
  reshape = _dims(m.group(2))
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  if m.group(3):
    ids = ids.transpose(_dims(m.group(3)))
  return ids.reshape(shape)


def _mesh_groups(spec: str) -> Optional[np.ndarray]:
  """Groups of a mesh-axes list `mesh['a'=2,'b'=4] {'b'}` (None where `spec` is not one)."""
  m = re.fullmatch(r"mesh\[(.*)\]\s*\{(.*)\}", spec.strip())
  if not m:
    return None
  axes = [(a.split("=")[0].strip().strip("'\""), int(a.split("=")[1]))
          for a in m.group(1).split(",") if "=" in a]
  inside = [a.strip().strip("'\"") for a in m.group(2).split(",") if a.strip()]
  names = [a for a, _ in axes]
  ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes])
  outer = [i for i, a in enumerate(names) if a not in inside]
  inner = [names.index(a) for a in inside]
  ids = ids.transpose(outer + inner)
  size = math.prod(axes[i][1] for i in inner)
  return ids.reshape(-1, size)


def collective_groups(ins: Instruction) -> list[list[int]]:
  """The device groups a collective runs over, or a permute's (source, target) pairs.

  For a collective-permute (or the send and recv XLA lowers one to), a
  list of [source, target]; otherwise the
  replica groups, in any of XLA's notations (explicit `{{0,1},{2,3}}`, an
  iota list `[2,2]<=[4]`, a mesh-axes list `mesh['axis_0'=2] {'axis_0'}`).
  Ids are the program's devices in the order of its device assignment (the
  mesh's devices, flattened). An empty list: one group of every device.
  """
  pairs = ins.attr("source_target_pairs")
  if pairs is None:  # a permute lowered to send and recv keeps its pairs here
    found = re.search(r"_xla_send_recv_source_target_pairs=(\{\{[\d,{}]*\}\})", ins.attrs)
    pairs = found.group(1) if found else None
  if pairs is not None:
    return [[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", pairs)]
  groups = ins.attr("replica_groups")
  if groups is None or groups in ("{}", "{{}}"):
    return []
  for parse in (_iota_groups, _mesh_groups):
    found = parse(groups)
    if found is not None:
      return found.tolist()
  return [[int(x) for x in g.split(",") if x.strip()]
          for g in re.findall(r"\{([\d,\s]+)\}", groups)]
