#!/usr/bin/env python3
"""Throughput benchmark of the pipeline schedules: an emulated CPU mesh, or two real cores.

  python tools/cpu/bench_pipeline.py                       # S=4, M=8: the targets' run
  python tools/cpu/bench_pipeline.py --repeats 7 --out-md /tmp/bench.md
  python tools/cpu/bench_pipeline.py --schedules 1f1b,"interleaved v2",zb1 --account 3 --no-compile-sweep
  python tools/cpu/bench_pipeline.py --sweep --out-md /tmp/sweep.md --out-png /tmp/bench_sweep.png
  python tools/cpu/bench_pipeline.py --two-core --remat dots --account 8 --out-md /tmp/two_core.md

In one process, for S stages and M microbatches (a model split into S
stages, one emulated device each; the one-device reference runs the same
global batch as M microbatches of gradient accumulation), it measures:

- step time of none, gpipe, 1f1b, 2bw and pipedream: the compiled step is
  run in round-robin over the schedules (so that a burst of load from other
  processes hits every schedule alike), warm-up steps first, then the median
  of --repeats timed steps, each ended by `jax.block_until_ready`;
- compile time of the 2bw step against M (`Schedule.lower_step(...).compile()`,
  with the persistent compilation cache off);
- memory per device from XLA's analysis of the compiled step
  (`compiled.memory_analysis()`: arguments, outputs, the part of the
  outputs aliased to donated arguments, and temporaries);
- the steady-state bubble of each schedule, counted from the engine's
  timetable (`jaxpipe.pipeline.timetable`), the same cells the visualiser draws.

With --account N, each schedule then runs N steps under the profiler, and
the report gains where they spent their time per device and phase and the
collectives each device ran per step (count and bytes, point to point and
in collectives; `tools/cpu/account.py`).

It prints markdown tables and the project's targets with PASS/MISS, and writes
them to --out-md; --sweep runs S in {2, 4} x M in {4, 8, 16} and draws step
time and bubble per schedule into --out-png.

The emulated devices are threads of one process that share this machine's
cores, so the ratios measure how much work each schedule does per step, not
how a real S-device pipeline would scale: see docs/benchmark.md.

--two-core measures real parallelism instead (tools/cpu/bench_two_core.py): a
process per configuration, pinned with taskset and with one XLA thread per
device: the one-device reference on one core, each schedule with S=2 stages
on two cores, the no-collective ceiling (two devices of one process, each
running the reference's step on its own data, nothing exchanged), and each
schedule of --processes as two jax.distributed processes, a stage and a core
each; --pairs rounds of one step of each, the speed-up of a round being the
reference's step time over the configuration's, split among --instances sets
of processes started one after the other (a process keeps its own offset of
a few percent for its life). It prints the median
speed-up, its quartiles and extremes, the bubble bound 2(1 - bubble), the
share of the ceiling and the targets, for each vocabulary of --vocab
(default bytes and GPT-2's); with --account N, also where N traced steps of
each configuration spent their time, per device and phase (tools/cpu/account.py).

Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
from bench_common import (LABELS, SCHEDULES, ModelShape, Runner, emulate_devices, memory_row,
                          parse_label, refusal, write)
from bench_report import (account_tables, compile_table, draw_sweep, load, machine,
                          memory_table, step_table, sweep_table, target_table)
from jaxpipe.cli import Parser
from jaxpipe.config import HEAD_CHOICES
from jaxpipe.model import REMAT_POLICIES
from jaxpipe.pipeline import STASH_MODES
# pylint: enable=g-import-not-at-top,wrong-import-position

SWEEP_STAGES = (2, 4)
SWEEP_MICROBATCHES = (4, 8, 16)

# The project's targets for the 2bw step: (label, numerator, denominator, limit).
TARGETS = (
    ("2bw step / gpipe step", "2bw", "gpipe", 0.8),
    ("2bw step / 1f1b step", "2bw", "1f1b", 0.8),
    ("2bw step / one-device step", "2bw", "none", 1.4),
)
COMPILE_LIMIT = 1.3


def bubble(schedule: str, num_stages: int, num_microbatches: int) -> Optional[float]:
  """Steady-state idle share of a schedule's stage time, read off the engine's step plan.

  `jaxpipe.pipeline.facts` counts it from the plan the engine executes (a
  forward costs 1, a backward 2; 2bw's fill step is not steady state); 0 for
  `none`, None where the schedule refuses the shape.
  """
  from jaxpipe.pipeline import facts  # pylint: disable=g-import-not-at-top
  if refusal(schedule, num_stages, num_microbatches):
    return None
  name, v = parse_label(schedule)
  return facts(name, num_stages, num_microbatches, v).bubble


def ticks(schedule: str, num_stages: int, num_microbatches: int) -> float:
  """Step length in tick-pairs (one forward and one backward per stage).

  A step's cost under the plan's cost model (forward 1, backward 2) over 3:
  M for 2bw, M+S-1 for gpipe, 1f1b and pipedream, whose forward-only and
  backward-only ticks are a third and two thirds of a pair; `none` runs M
  microbatches of the whole model (S stages' work) on one device: M*S.
  NaN where the schedule refuses the shape (the tables print it as such).
  """
  from jaxpipe.pipeline import facts  # pylint: disable=g-import-not-at-top
  if refusal(schedule, num_stages, num_microbatches):
    return float("nan")
  name, v = parse_label(schedule)
  return facts(name, num_stages, num_microbatches, v).step_cost / 3


def measure(shape: ModelShape, num_stages: int, num_microbatches: int, *, warmup: int,
            repeats: int, schedules: Sequence[str] = LABELS, account: int = 0,
            log=print) -> list[dict[str, Any]]:
  """Compiles every schedule (`LABELS`), then times them in round-robin; one dict per schedule.

  With `account` > 0, each schedule then runs that many steps under the
  profiler, and its row gains their account (`Runner.account`).
  """
  runners, rows = [], []
  for name in schedules:
    row: dict[str, Any] = {"schedule": name, "stages": num_stages, "microbatches": num_microbatches,
                           "ticks": ticks(name, num_stages, num_microbatches),
                           "bubble": bubble(name, num_stages, num_microbatches)}
    rows.append(row)
    why = refusal(name, num_stages, num_microbatches, shape.layers)
    if why:
      row["skipped"] = why
      continue
    r = Runner(shape, name, num_stages, num_microbatches)
    row.update(compile_s=r.compile_s, compile_cpu_s=r.compile_cpu_s, lower_s=r.lower_s,
               memory=memory_row(r.memory))
    log(f"  S={num_stages} M={num_microbatches} {name}: compiled in {r.compile_s:.1f} s "
        f"({r.compile_cpu_s:.1f} CPU s)")
    runners.append((r, row))
  times: dict[str, list[float]] = {r.name: [] for r, _ in runners}
  cpu: dict[str, list[float]] = {r.name: [] for r, _ in runners}
  for i in range(warmup + repeats):
    for r, _ in runners:
      wall, cpu_s = r.step()
      if i >= warmup:
        times[r.name].append(wall)
        cpu[r.name].append(cpu_s)
  for r, row in runners:
    row.update(step_s=statistics.median(times[r.name]), step_min_s=min(times[r.name]),
               step_max_s=max(times[r.name]), times=times[r.name],
               cpu_s=statistics.median(cpu[r.name]),
               cores=sum(cpu[r.name]) / sum(times[r.name]))
    if account:
      row["account"] = r.account(account)
  return rows


def compile_vs_m(shape: ModelShape, num_stages: int, ms: Sequence[int],
                 done: Optional[dict[str, Any]] = None, log=print) -> list[dict[str, Any]]:
  """Lowering and compile time of the 2bw step for each M (a fresh schedule each).

  `done`: the 2bw row of `measure` for the same S, reused for its M rather
  than compiling the same program twice.
  """
  out = []
  for m in ms:
    if done is not None and done.get("microbatches") == m and "compile_s" in done:
      out.append({k: done[k] for k in ("microbatches", "lower_s", "compile_s", "compile_cpu_s",
                                       "memory")})
      continue
    r = Runner(shape, "2bw", num_stages, m)
    log(f"  2bw S={num_stages} M={m}: lowered in {r.lower_s:.2f} s, compiled in "
        f"{r.compile_s:.1f} s ({r.compile_cpu_s:.1f} CPU s)")
    out.append({"microbatches": m, "lower_s": r.lower_s, "compile_s": r.compile_s,
                "compile_cpu_s": r.compile_cpu_s, "memory": memory_row(r.memory)})
    del r
  return out


def targets(rows: list[dict[str, Any]], compile_rows: list[dict[str, Any]]
            ) -> list[dict[str, Any]]:
  """The project's targets, on wall-clock and on CPU time, with the tick-count prediction.

  Each entry: target, wall, cpu (ratios), limit, status (on wall, the project's
  measure), cpu_status, predicted (tick counts; None for the one-device step).
  """
  by = {r["schedule"]: r for r in rows if "step_s" in r}
  out = []

  def entry(label, wall, cpu, limit, predicted):
    return {"target": label, "wall": wall, "cpu": cpu, "limit": limit, "predicted": predicted,
            "status": "PASS" if wall <= limit else "MISS",
            "cpu_status": "PASS" if cpu <= limit else "MISS"}

  for label, num, den, limit in TARGETS:
    if num not in by or den not in by:
      continue
    s_, m = by[num]["stages"], by[num]["microbatches"]
    predicted = ticks(num, s_, m) / ticks(den, s_, m) if den != "none" else None
    out.append(entry(label, by[num]["step_s"] / by[den]["step_s"],
                     by[num]["cpu_s"] / by[den]["cpu_s"], limit, predicted))
  if len(compile_rows) >= 2:
    first, last = compile_rows[0], compile_rows[-1]
    out.append(entry(f"2bw compile M={last['microbatches']} / M={first['microbatches']}",
                     last["compile_s"] / first["compile_s"],
                     last["compile_cpu_s"] / first["compile_cpu_s"], COMPILE_LIMIT, 1.0))
  return out



def _int_list(text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def _names(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def _labels(args) -> list[str]:
  """The schedules to measure: --schedules, with none and 2bw (the report compares to them)."""
  return list(dict.fromkeys(["none", "2bw", *args.schedules]))


def _check(args, shape: ModelShape) -> None:
  """Raises ValueError (one line) for settings the engine would refuse."""
  if args.account < 0 or args.account == 1:
    raise ValueError(f"--account must be 0 (off) or >= 2 steps (the first traced step has "
                     f"no predecessor to measure its gap from), got {args.account}")
  stages = SWEEP_STAGES if args.sweep else (2,) if args.two_core else (args.stages,)
  for s_ in stages:
    if s_ < 1:
      raise ValueError(f"--stages must be >= 1, got {s_}")
    if shape.layers % s_:
      raise ValueError(f"--layers={shape.layers} is not divisible by {s_} stages")
  if args.microbatches < 1:
    raise ValueError(f"--microbatches must be >= 1, got {args.microbatches}")
  for label in args.schedules:
    parse_label(label)   # raises ValueError naming the labels
  if args.two_core:
    cores = args.cores.split(",")
    if len(cores) != 2 or not all(c.strip().isdigit() for c in cores) or cores[0] == cores[1]:
      raise ValueError(f"--cores must name two different cores, e.g. 0,1; got {args.cores!r}")
    if not {int(c) for c in cores} <= os.sched_getaffinity(0):
      raise ValueError(f"--cores {args.cores}: this process may only run on cores "
                       f"{sorted(os.sched_getaffinity(0))}")
    if args.sweep:
      raise ValueError("--two-core and --sweep are separate measurements; pick one")
    if shape.layers % 2:
      raise ValueError(f"--layers={shape.layers} is not divisible by the 2 stages of --two-core")
    if args.pairs < 3:
      raise ValueError(f"--pairs must be >= 3 for a median and a spread, got {args.pairs}")
    if args.instances is None:
      args.instances = 2 if args.pairs >= 6 else 1
    if not 1 <= args.instances <= args.pairs // 3:
      raise ValueError(f"--instances must be between 1 and --pairs/3 (3 rounds a set at "
                       f"least), got {args.instances} for --pairs {args.pairs}")
    if args.back_to_back < 1:
      raise ValueError(f"--back-to-back must be >= 1, got {args.back_to_back}")
    if min(args.vocab) < 257:
      raise ValueError(f"--vocab must be >= 257 (the byte vocabulary), got {args.vocab}")
    for option, value in (("--xla-flags", args.xla_flags),
                          ("--compare-xla-flags", args.compare_xla_flags)):
      bad = [f for f in value.split() if not re.fullmatch(r"--xla_\w+(=\S*)?", f)]
      if bad:
        raise ValueError(f"{option} takes XLA flags such as --xla_cpu_use_xnnpack=false; "
                         f"got {bad[0]!r}")
    bad = [v for v in args.compare_env.split() if not re.fullmatch(r"[A-Za-z_]\w*=\S*", v)]
    if bad:
      raise ValueError(f"--compare-env takes NAME=VALUE settings such as "
                       f"GLIBC_TUNABLES=glibc.malloc.tcache_count=7; got {bad[0]!r}")
    import shutil  # pylint: disable=g-import-not-at-top
    if shutil.which("taskset") is None:
      raise ValueError("--two-core pins processes with taskset, which is not installed "
                       "(util-linux)")
    if args.microbatches < 2:
      raise ValueError(f"2bw with 2 stages needs --microbatches >= 2, got {args.microbatches}")
    bad = [n for n in args.processes if n not in SCHEDULES[1:]]
    if bad:
      raise ValueError(f"--processes {','.join(bad)}: not a pipelined schedule; choose from "
                       f"{', '.join(SCHEDULES[1:])}")
    return
  if args.instances is not None:
    raise ValueError("--instances splits the rounds of --two-core; add --two-core or drop it")
  if args.account and args.sweep:
    raise ValueError("--account traces the schedules of one shape; drop --sweep or --account")
  if args.repeats < 1 or args.warmup < 1:
    raise ValueError("--repeats and --warmup must be >= 1 (the first run of a program "
                     "pays for allocations)")
  need = 2 * (args.stages - 1)
  if not args.sweep and args.microbatches < need:
    raise ValueError(f"2bw with {args.stages} stages needs --microbatches >= 2(S-1) = {need}, "
                     f"got {args.microbatches}")
  if min(args.compile_m) < need:
    raise ValueError(f"--compile-m values must be >= 2(S-1) = {need} for 2bw")
  for key in ("dim", "heads", "kv_heads", "seq_len", "micro_rows"):
    if getattr(shape, key) < 1:
      raise ValueError(f"--{key.replace('_', '-')} must be >= 1")
  if shape.dim % shape.heads or (shape.dim // shape.heads) % 2 or shape.heads % shape.kv_heads:
    raise ValueError(f"--dim={shape.dim}, --heads={shape.heads}, --kv-heads={shape.kv_heads}: "
                     "dim must split into heads of even size, heads into kv groups")


def _parser() -> Parser:
  """The command line: the (S, M) point or the sweep, the model's shape, the outputs."""
  parser = Parser(prog="bench_pipeline", description=__doc__.split("\n\n")[0])
  parser.add_argument("--stages", type=int, default=4, help="S (default 4)")
  parser.add_argument("--microbatches", type=int, default=8, help="M (default 8)")
  parser.add_argument("--sweep", action="store_true",
                      help="S in {2, 4} x M in {4, 8, 16} instead of one (S, M)")
  parser.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (default 5)")
  parser.add_argument("--warmup", type=int, default=1,
                      help="untimed steps per schedule first (default 1)")
  parser.add_argument("--compile-m", type=_int_list, default=[8, 16, 32],
                      help="M values for the 2bw compile-time sweep (default 8,16,32)")
  parser.add_argument("--no-compile-sweep", action="store_true", help="skip compile time vs M")
  d = ModelShape()
  parser.add_argument("--dim", type=int, default=d.dim, help=f"model width (default {d.dim})")
  parser.add_argument("--layers", type=int, default=d.layers, help=f"blocks (default {d.layers})")
  parser.add_argument("--heads", type=int, default=d.heads)
  parser.add_argument("--kv-heads", type=int, default=d.kv_heads)
  parser.add_argument("--seq-len", type=int, default=d.seq_len,
                      help=f"tokens per sequence (default {d.seq_len})")
  parser.add_argument("--micro-rows", type=int, default=d.micro_rows,
                      help=f"sequences per microbatch (default {d.micro_rows})")
  parser.add_argument("--out-md", default="", help="write the markdown report here")
  parser.add_argument("--out-png", default="", help="sweep: write the plot here")
  parser.add_argument("--out-json", default="", help="write every measurement (raw) here")
  parser.add_argument("--remat", choices=REMAT_POLICIES, default=d.remat,
                      help=f"model.remat (default {d.remat})")
  parser.add_argument("--stash", choices=STASH_MODES, default=d.stash,
                      help=f"pipeline.stash (default {d.stash})")
  parser.add_argument("--head", choices=HEAD_CHOICES, default=d.head,
                      help=f"pipeline.head (default {d.head})")
  parser.add_argument("--two-core", action="store_true",
                      help="real parallelism: S=2 stages on two cores against one device on one "
                           "core, a pinned process each (see docs/benchmark.md)")
  parser.add_argument("--vocab", type=_int_list, default=[257, 50257],
                      help="two-core: vocabularies to measure (default 257,50257)")
  parser.add_argument("--pairs", type=int, default=20,
                      help="two-core: timed rounds, one step of every process each (default 20)")
  parser.add_argument("--instances", type=int, default=None,
                      help="two-core: sets of processes the rounds are split among, started "
                           "one after the other (default 2, or 1 below 6 rounds: a process's "
                           "step time keeps its own offset of a few percent for its life, so "
                           "one set is one draw)")
  parser.add_argument("--back-to-back", type=int, default=1,
                      help="two-core: steps each process runs in a row per turn, the last timed "
                      "(default 1: every step follows the other processes' steps)")
  parser.add_argument("--schedules", type=_names, default=list(LABELS),
                      help="schedules to measure, comma-separated (default all: "
                           f"{','.join(LABELS)}); none and 2bw are always measured")
  parser.add_argument("--processes", type=_names, default=["2bw", "1f1b"],
                      help="two-core: schedules to also run as two jax.distributed processes, "
                           "a stage each ('' for none; default 2bw,1f1b)")
  parser.add_argument("--account", type=int, default=0,
                      help="afterwards trace this many steps of each configuration and "
                           "account for their time by phase and their collectives (two-core: "
                           "the last set of processes; default 0: off)")
  parser.add_argument("--cores", default="0,1",
                      help="two-core: the two CPU cores to pin to (default 0,1)")
  parser.add_argument("--xla-flags", default="",
                      help="two-core: XLA flags added to every process's XLA_FLAGS (default none)")
  parser.add_argument("--compare-xla-flags", default="",
                      help="two-core: also run the reference, the ceiling and each schedule "
                           "compiled with these XLA flags on top, in the same rounds (rows "
                           "'S [B]'; default none)")
  parser.add_argument("--compare-env", default="",
                      help="two-core: NAME=VALUE settings (space-separated) in the environment "
                           "of the [B] rows (with --compare-xla-flags or alone; default none)")
  return parser


def _sections(args, shape: ModelShape, log) -> tuple[list[tuple[str, str]], list, list]:
  """Measures what `args` ask for: (titled report sections, step rows, compile rows)."""
  sections, compile_rows = [], []
  if args.sweep:
    rows = []
    for s_ in SWEEP_STAGES:
      for m in SWEEP_MICROBATCHES:
        rows += measure(shape, s_, m, warmup=args.warmup, repeats=args.repeats,
                        schedules=_labels(args), log=log)
    sections.append(("Sweep: step time per schedule (global batch = M x "
                     f"{shape.micro_rows} sequences)", sweep_table(rows)))
    return sections, rows, compile_rows
  rows = measure(shape, args.stages, args.microbatches, warmup=args.warmup,
                 repeats=args.repeats, schedules=_labels(args), account=args.account, log=log)
  if not args.no_compile_sweep and args.compile_m:
    done = next(r for r in rows if r["schedule"] == "2bw")
    compile_rows = compile_vs_m(shape, args.stages, args.compile_m, done=done, log=log)
  s_, m = args.stages, args.microbatches
  sections.append((f"Step time, S={s_}, M={m}, global batch {m * shape.micro_rows} x "
                   f"{shape.seq_len} tokens ({args.repeats} timed steps after {args.warmup} "
                   "warm-up, round-robin)", step_table(rows)))
  sections.append(("Memory per device, MiB (XLA memory analysis of the compiled step)",
                   memory_table(rows)))
  if compile_rows:
    sections.append((f"2bw compile time against M (S={s_})", compile_table(compile_rows)))
  sections.append(("Targets", target_table(targets(rows, compile_rows))))
  accounts = {r["schedule"]: r["account"] for r in rows if "account" in r}
  if accounts:
    sections.append((f"Where each step's time went, ms per step ({args.account} traced steps, "
                     "the emulated devices sharing the cores)", account_tables(accounts)))
  return sections, rows, compile_rows


def main(argv: Optional[list[str]] = None) -> int:
  """Runs the benchmark (or the sweep) and prints / writes the tables."""
  args = _parser().parse_args(argv)
  shape = ModelShape(args.dim, args.layers, args.heads, args.kv_heads, args.seq_len,
                     args.micro_rows, remat=args.remat, stash=args.stash, head=args.head)
  try:
    _check(args, shape)
  except ValueError as e:
    print(f"bench_pipeline: {e}", file=sys.stderr)
    return 2
  if args.two_core:
    import bench_two_core  # pylint: disable=g-import-not-at-top
    return bench_two_core.run(args, shape)
  if args.out_png and not args.sweep:
    print("bench_pipeline: --out-png draws the sweep; add --sweep", file=sys.stderr)
    return 2

  stages = SWEEP_STAGES if args.sweep else (args.stages,)
  emulate_devices(max(stages))
  import jax  # pylint: disable=g-import-not-at-top
  # Compile times must be real compilations, not cache hits.
  jax.config.update("jax_enable_compilation_cache", False)

  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  started, load_before = time.time(), load()
  header = [f"machine: {machine()}",
            f"model: {shape.layers} blocks, width {shape.dim}, {shape.heads} heads "
            f"({shape.kv_heads} kv), vocab 257, seq {shape.seq_len}; microbatch "
            f"{shape.micro_rows} sequences; adamw; float32",
            f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}",
            f"load average (1/5/15 min) at start: {load_before}"]
  for line in header:
    log(line)
  sections, rows, compile_rows = _sections(args, shape, log)
  elapsed = time.time() - started
  footer = [f"load average at end: {load()}; wall time {elapsed:.0f} s"]
  text = "\n".join(header) + "\n\n" + "\n\n".join(f"### {t}\n\n{body}" for t, body in sections)
  text += "\n\n" + "\n".join(footer) + "\n"
  print(text)
  write(text, args.out_md, log)
  if args.out_json:
    write(json.dumps({"header": header, "footer": footer, "rows": rows,
                       "compile": compile_rows if not args.sweep else []}, indent=1),
           args.out_json, log)
  if args.sweep and args.out_png:
    log(f"wrote {draw_sweep(rows, args.out_png, f'{header[1]}; load {load_before}')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
