"""The tables of docs/accelerators.md: the shipped configs compiled for GPU targets here, read.

  python tools/gpu_table.py --json-dir runs/gpu_table          # every row (about 30 min on 2 cores)
  python tools/gpu_table.py --json-dir runs/gpu_table --reuse  # format the JSON already there
  python tools/gpu_table.py --json-dir runs/gpu_table --rows smollm-135m/h100

Each row is one `tools/planner.py --config configs/CONFIG.yaml --compile
--gpu KIND --nodes N --json [overrides]` run in its own process (the
planner emulates the config's devices for its CPU compile before JAX
starts), its JSON kept as JSON_DIR/<row>.json; the tables are printed as
Markdown: one row per config, GPU kind and mesh with the GPU compile's
memory per device beside the CPU compile's and the planner's estimate, the
attention kernel, the collectives and the projected step and MFU
(`jaxpipe.gpu`: a projection, not a measurement). --reuse formats the JSON
files already in JSON_DIR instead of compiling again.

A bad argument exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, NamedTuple, Optional

from jaxpipe.cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Row(NamedTuple):
  """One planner run: a shipped config on a GPU kind over some nodes, with overrides."""
  name: str
  config: str
  kind: str
  nodes: int
  overrides: tuple[str, ...] = ()


_ONE_NODE = [Row(f"{c}/{k}", c, k, 1) for c in ("smollm-135m", "smollm-360m", "llama-1b")
             for k in ("h100", "h200")]
# The paper's scale: llama-1b on 4 nodes of 8 GPUs (4 stages x 8 replicas) and
# moe-10b's 64 GPUs as 8 nodes of 8, 2bw against 1f1b on the same mesh, with
# the head split over the stages (pipeline.head=auto's choice) and on the last.
_NODES = [Row(f"{c}/{k}/{n}x8/{s}/{h}", c, k, n,
              (*(("mesh.data=8",) if c == "llama-1b" else ()), f"pipeline.schedule={s}",
               f"pipeline.head={h}"))
          for c, n in (("llama-1b", 4), ("moe-10b", 8)) for k in ("h100", "h200")
          for s in ("2bw", "1f1b") for h in ("auto", "last_stage")]
ROWS = {r.name: r for r in _ONE_NODE + _NODES}


def _file(json_dir: str, row: Row) -> str:
  return os.path.join(json_dir, row.name.replace("/", "_") + ".json")


def command(row: Row) -> list[str]:
  """The planner command of a row, as the docs print it."""
  return ["tools/planner.py", "--config", f"configs/{row.config}.yaml", "--compile", "--gpu",
          row.kind, *(["--nodes", str(row.nodes)] if row.nodes > 1 else []), "--json",
          *row.overrides]


def run(row: Row, json_dir: str) -> dict[str, Any]:
  """Runs the planner for `row` (its own process) and keeps its JSON; the JSON."""
  p = subprocess.run([sys.executable, *command(row)], capture_output=True, text=True, cwd=ROOT,
                     timeout=3600)
  if p.returncode != 0:
    raise RuntimeError(f"{row.name}: the planner failed ({p.returncode}): "
                       f"{p.stderr.strip()[-400:]}")
  with open(_file(json_dir, row), "w") as f:
    f.write(p.stdout)
  return json.loads(p.stdout)


def _sum(collectives: list[dict[str, Any]], keep) -> tuple[int, float, float]:
  """(count, GB, exposed ms) per step of the collectives `keep` selects."""
  rows = [c for c in collectives if keep(c)]
  return (sum(c["count"] for c in rows), sum(c["count"] * c["bytes"] for c in rows) / 1e9,
          sum(c["count"] * c["exposed_s"] for c in rows) * 1e3)


def table(rows: list[tuple[Row, dict[str, Any]]]) -> str:
  """The Markdown table of the rows' planner JSON."""
  head = ("| config | GPUs | schedule, head | resident GiB: GPU compile / CPU compile / "
          "estimate | fits | attention | stage-to-stage sends per step (exposed) | other "
          "collectives per step (exposed) | projected step | projected MFU |")
  lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
  for row, j in rows:
    g, cfg = j["gpu"], j["config"]
    sends = _sum(g["collectives"], lambda c: c["phase"] == "send")
    other = _sum(g["collectives"], lambda c: c["phase"] != "send")
    across = any(c["across_nodes"] for c in g["collectives"] if c["phase"] == "send")
    mesh = (f"{g['devices']} {row.kind.upper()} ({cfg['stages']}x{cfg['data']}, "
            f"{g['nodes']} node{'s' if g['nodes'] > 1 else ''})")
    head_choice = "vocab-parallel" if j["vocab_parallel"] else "last stage"
    kernels = "cuDNN" if g["attention"]["implementation"] == "cudnn" else \
        g["attention"]["implementation"]
    lines.append(
        f"| {row.config} | {mesh} | {cfg['schedule']}, {head_choice} | "
        f"{g['resident_gib']:.1f} / {j['xla_resident_gib']:.1f} / {j['estimate_gib']:.1f} | "
        f"{'yes' if g['fits'] else 'NO'} ({g['usable_gib']:.0f}) | {kernels} | "
        f"{sends[0]}, {sends[1]:.2f} GB{' across nodes' if across else ''} "
        f"({sends[2]:.1f} ms) | {other[0]}, {other[1]:.2f} GB ({other[2]:.1f} ms) | "
        f"{g['projected_step_s'] * 1e3:.0f} ms | {g['projected_mfu']:.1%} |")
  return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
  """Runs (or reuses) the rows' planner JSON and prints the Markdown table."""
  parser = Parser(prog="gpu_table", description=__doc__.split("\n\n")[0])
  parser.add_argument("--json-dir", required=True, help="folder for each row's planner JSON")
  parser.add_argument("--reuse", action="store_true",
                      help="format the JSON files already in --json-dir; compile nothing")
  parser.add_argument("--rows", default="",
                      help=f"comma-separated row names (default: all {len(ROWS)})")
  args = parser.parse_args(argv)
  names = [n for n in args.rows.split(",") if n] or list(ROWS)
  unknown = [n for n in names if n not in ROWS]
  if unknown:
    print(f"gpu_table: unknown row {unknown[0]!r}; rows are {', '.join(ROWS)}", file=sys.stderr)
    return 2
  os.makedirs(args.json_dir, exist_ok=True)
  out = []
  for name in names:
    row = ROWS[name]
    path = _file(args.json_dir, row)
    if args.reuse:
      if not os.path.exists(path):
        print(f"gpu_table: --reuse but {path} is missing; run without --reuse", file=sys.stderr)
        return 2
      with open(path) as f:
        out.append((row, json.load(f)))
    else:
      print(f"gpu_table: {name} ...", file=sys.stderr, flush=True)
      try:
        out.append((row, run(row, args.json_dir)))
      except RuntimeError as e:
        print(f"gpu_table: {e}", file=sys.stderr)
        return 1
  print(table(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
