#!/usr/bin/env python3
"""Throughput and MFU of each schedule for a real model shape, on whatever devices exist.

  python tools/bench_accel.py                      # SmolLM-135M shapes, on the accelerator
  python tools/bench_accel.py --preset cpu         # a small shape that finishes on a CPU

For each schedule it builds the model and optimizer of the config (bfloat16
compute, float32 weights as the config says), places them on a mesh of
`--stages` x the remaining devices, compiles the step (timed), runs warm-up
steps, then times `--steps` steps on random tokens and reports tokens/s, model
TFLOP/s per device and MFU (when the device's peak is known or given with
--peak-tflops). A single accelerator runs every schedule with one stage, which
measures what each engine costs over plain training on that device; on CPU
only tokens/s are meaningful. The default GPU run takes a few minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PRESETS = {
    # SmolLM-135M blocks on 2048-token sequences: 32 sequences per step.
    "gpu": dict(config="configs/smollm-135m.yaml", batch=32, seq=2048, microbatches=8,
                steps=10, vocab=49152),
    # Small enough for two CPU cores in about a minute.
    "cpu": dict(config="configs/tiny.yaml", batch=16, seq=128, microbatches=4, steps=3,
                vocab=257, dim=64, layers=4, stages=2),
}


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                 help="gpu (default on an accelerator) or cpu (default on a CPU)")
  p.add_argument("--config", help="model and optimizer come from this config")
  p.add_argument("--schedules", default="none,gpipe,1f1b,2bw")
  p.add_argument("--stages", type=int, default=0, help="0 = as many as devices, at most 4")
  p.add_argument("--microbatches", type=int)
  p.add_argument("--batch", type=int, help="global batch in sequences")
  p.add_argument("--seq", type=int)
  p.add_argument("--steps", type=int, help="timed steps per schedule (after 2 warm-up steps)")
  p.add_argument("--peak-tflops", type=float, default=0.0,
                 help="per-device peak for MFU (default: known accelerators)")
  p.add_argument("--out-md", help="also write the table to this markdown file")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _args(argv)
  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe.errors import ConfigError, InputError  # pylint: disable=g-import-not-at-top
  try:
    import jax  # pylint: disable=g-import-not-at-top
    preset = PRESETS[args.preset or ("cpu" if jax.default_backend() == "cpu" else "gpu")]
    cfg = config_lib.load(os.path.join(ROOT, args.config or preset["config"]))
    model_cfg = dataclasses.replace(cfg.model, vocab_size=preset["vocab"])
    if "dim" in preset and not args.config:
      model_cfg = dataclasses.replace(model_cfg, dim=preset["dim"], n_layers=preset["layers"])
    batch, seq = args.batch or preset["batch"], args.seq or preset["seq"]
    m = args.microbatches or preset["microbatches"]
    steps = args.steps or preset["steps"]
    stages = args.stages or preset.get("stages") or min(4, jax.device_count())
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for name in names:
      if name not in config_lib.SCHEDULES:
        raise ConfigError(f"unknown schedule '{name}'; choose from "
                                     f"{', '.join(config_lib.SCHEDULES)}")
    from jaxpipe.pipeline import min_microbatches  # pylint: disable=g-import-not-at-top
    for name in names:
      if m < min_microbatches(name, stages if name != "none" else 1):
        raise ConfigError(f"{name} with {stages} stages needs --microbatches >= "
                          f"{min_microbatches(name, stages)}")
    if model_cfg.n_layers % stages:
      raise ConfigError(f"{model_cfg.n_layers} layers do not split into "
                                   f"--stages {stages}")
    if batch % m or (batch // m) % max(1, jax.device_count() // stages):
      raise ConfigError(f"--batch {batch} does not split into {m} microbatches "
                                   "over the data-parallel devices")
    rows = run(model_cfg, cfg.optimizer, names, stages, batch, seq, m, steps,
               args.peak_tflops)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  table = format_table(rows)
  print(table)
  if args.out_md:
    with open(args.out_md, "w") as f:
      f.write(table + "\n")
  return 0


def run(model_cfg, opt_cfg, names, stages, batch, seq, m, steps, peak=0.0) -> list[dict]:
  """Measures each schedule; returns one row (a dict) per schedule."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe import model as model_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh, make_schedule  # pylint: disable=g-import-not-at-top

  model, fns, optimizer = trainer.components(
      config_lib.Config(model=model_cfg, optimizer=opt_cfg))
  devices = jax.devices()
  kind = devices[0].device_kind
  peak = peak or trainer.device_peak_tflops(kind) or 0.0
  flops_token = model_lib.flops_per_token(model_cfg, seq)
  params = jax.jit(model.init)(jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, model_cfg.vocab_size, (steps + 2, m, batch // m, seq + 1))
  rows = []
  for name in names:
    s = 1 if name == "none" else stages
    d = max(1, len(devices) // stages) if name != "none" else len(devices)
    mesh = make_mesh(s, d, devices)
    sch = make_schedule(name, fns, optimizer, mesh, m)
    state = sch.init(params, (m, batch // m, seq))
    put = lambda x: jax.device_put(jnp.asarray(x, jnp.int32), sch.batch_sharding())
    tok, tgt = put(tokens[0, ..., :-1]), put(tokens[0, ..., 1:])
    t0 = time.perf_counter()
    sch.lower_step(state, tok, tgt).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(steps + 2):
      tok, tgt = put(tokens[i, ..., :-1]), put(tokens[i, ..., 1:])
      t0 = time.perf_counter()
      state, met = sch.step(state, tok, tgt)
      jax.block_until_ready(met["loss"])
      if i >= 2:
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    tokens_s = batch * seq / step_s
    tflops = flops_token * tokens_s / (s * d) / 1e12
    rows.append({"schedule": name, "mesh": f"{s}x{d}", "devices": s * d, "kind": kind,
                 "compile_s": compile_s, "step_s": step_s, "tokens_per_s": tokens_s,
                 "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
                 "loss": float(met["loss"])})
    del state
  return rows


def format_table(rows: list[dict]) -> str:
  """A markdown table of the measured rows."""
  lines = ["| schedule | stage x data | step (s) | tokens/s | TFLOP/s per device | MFU | compile (s) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    lines.append(f"| {r['schedule']} | {r['mesh']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} "
                 f"| {r['tflops_per_device']:.3g} | {mfu} | {r['compile_s']:.1f} |")
  if rows:
    lines.append(f"\ndevice: {rows[0]['kind']}")
  return "\n".join(lines)


if __name__ == "__main__":
  # Four CPU devices for the CPU preset's mesh; accelerators are unaffected.
  _flag = "--xla_force_host_platform_device_count"
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}=4".strip()
  sys.exit(main())
