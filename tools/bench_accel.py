#!/usr/bin/env python3
"""Throughput, MFU and HFU of each schedule for a real model shape, on whatever devices exist.

  python tools/bench_accel.py                      # SmolLM-135M shapes, on the accelerator
  python tools/bench_accel.py --preset cpu         # a small shape that finishes on a CPU

For each schedule it builds the model and optimizer of the config (bfloat16
compute, float32 weights as the config says) and measures it
(`jaxpipe.bench.measure`): `none` on every device as data replicas, the
pipelines on `--stages` x the remaining devices. The stage count defaults to
the largest one up to 4 that divides the layers and the devices; the batch
is rounded up so that every schedule's microbatch splits over its replicas
(an explicit --batch that does not is refused). It compiles the step
(timed), runs warm-up steps, then times `--steps` steps on random tokens and
prints tokens/s, model TFLOP/s per device, MFU (causal attention, and with
attention counted in full), HFU (recomputation counted) and XLA's bytes per
device. A single device runs every schedule with one stage, which measures
what each engine costs over plain training on that device. On a CPU only
tokens/s mean anything. A bad option or combination exits with status 2 and
one line on stderr.
"""

from __future__ import annotations

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PRESETS = {
    # SmolLM-135M blocks on 2048-token sequences: 32 sequences per step
    # (rounded up to split over the replicas), the config's stash and remat.
    "gpu": dict(config="configs/smollm-135m.yaml", batch=32, seq=2048, microbatches=8,
                steps=10, vocab=49152),
    # Small enough for two CPU cores in about a minute.
    "cpu": dict(config="configs/tiny.yaml", batch=16, seq=128, microbatches=4, steps=3,
                vocab=257, dim=64, layers=4, stages=2),
}


def _args(argv):
  from jaxpipe.cli import Parser  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import STASH_MODES  # pylint: disable=g-import-not-at-top
  p = Parser(prog="bench_accel", description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                 help="gpu (default on an accelerator) or cpu (default on a CPU)")
  p.add_argument("--config", help="model and optimizer come from this config")
  p.add_argument("--schedules", default="none,gpipe,1f1b,2bw")
  p.add_argument("--stages", type=int, default=0,
                 help="stages of the pipelines; 0 = the largest up to 4 that divides the layers "
                      "and the devices")
  p.add_argument("--stash", choices=STASH_MODES,
                 help="pipeline.stash of the pipelines (default: the config's)")
  p.add_argument("--microbatches", type=int)
  p.add_argument("--batch", type=int, help="global batch in sequences (must split over replicas)")
  p.add_argument("--seq", type=int)
  p.add_argument("--steps", type=int, help="timed steps per schedule (after 2 warm-up steps)")
  p.add_argument("--peak-tflops", type=float, default=0.0,
                 help="per-device dense bf16 peak for MFU (default: jaxpipe.accel.PEAK_TFLOPS "
                      "by the exact device kind)")
  p.add_argument("--out-md", help="also write the table to this markdown file")
  return p.parse_args(argv)


def main(argv=None) -> int:
  """Plans the meshes, measures each schedule and prints the table; the exit status."""
  args = _args(argv)
  from jaxpipe import accel, bench, config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe.errors import ConfigError, InputError  # pylint: disable=g-import-not-at-top
  try:
    if args.peak_tflops < 0:
      raise ConfigError(f"--peak-tflops must be >= 0, got {args.peak_tflops:g}")
    for name in ("steps", "seq"):
      if getattr(args, name) is not None and getattr(args, name) < 1:
        raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    import jax  # pylint: disable=g-import-not-at-top
    preset = PRESETS[args.preset or ("cpu" if jax.default_backend() == "cpu" else "gpu")]
    cfg = config_lib.load(os.path.join(ROOT, args.config or preset["config"]))
    model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or preset["vocab"])
    if "dim" in preset and not args.config:
      model_cfg = dataclasses.replace(model_cfg, dim=preset["dim"], n_layers=preset["layers"])
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    plan = bench.mesh_plan(
        jax.device_count(), model_cfg.n_layers, names,
        microbatches=args.microbatches or preset["microbatches"],
        batch=args.batch or preset["batch"], stages=args.stages,
        max_stages=preset.get("stages", bench.MAX_AUTO_STAGES), batch_fixed=bool(args.batch))
    seq, steps = args.seq or preset["seq"], args.steps or preset["steps"]
    peak = args.peak_tflops or accel.device_peak_tflops(jax.devices()[0].device_kind)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    rows = [bench.measure(model_cfg, cfg.optimizer, name, plan.meshes[name], batch=plan.batch,
                          seq=seq, microbatches=plan.microbatches, steps=steps,
                          stash=args.stash or cfg.pipeline.stash, peak=peak, say=say)
            for name in names]
  except InputError as e:
    print(f"bench_accel: {e}", file=sys.stderr)
    return 2
  memory = accel.device_memory(jax.devices())
  peaks = [r["peak_bytes_in_use"] for r in memory or () if r["peak_bytes_in_use"] is not None]
  table = bench.format_table(rows, peak, max(peaks) / 2 ** 30 if peaks else None)
  print(table)
  if args.out_md:
    with open(args.out_md, "w") as f:
      f.write(table + "\n")
  return 0


def _xla_flags() -> str:
  """XLA_FLAGS for the benchmark: emulated CPU devices, or training's defaults on NVIDIA GPUs."""
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  flags = os.environ.get("XLA_FLAGS", "")
  # CPU devices for the CPU preset's mesh (four, unless XLA_FLAGS says how
  # many); accelerators are unaffected.
  if "--xla_force_host_platform_device_count" not in flags:
    flags = f"{flags} --xla_force_host_platform_device_count=4".strip()
  if accel.gpu_expected():
    # What train.py sets by default (run.deterministic=true, a pipelined
    # schedule), for every schedule measured in this one process.
    flags = accel.merge_xla_flags(flags, accel.gpu_xla_flags(deterministic=True, pipelined=True))
  return flags


if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = _xla_flags()  # before JAX starts
  sys.exit(main())
