"""Checks jaxpipe on one NVIDIA GPU in a few minutes and writes what it measured.

  python tools/device_check.py --out device_check          # on a machine with a GPU
  python tools/device_check.py --dry-run --out /tmp/dc      # on a CPU: tiny shapes, no GPU parts

Parts, each run on its own, so that one failure loses nothing else (its
error and traceback are recorded instead):

  environment  jax and jaxlib, the backend, the device kind and its peak, XLA_FLAGS.
  attention    cuDNN's fused attention against the blockwise one in bfloat16,
               values and gradients, each against XLA's attention in float32
               on the same inputs; passes when both are within ATTENTION_TOL
               of that reference (the largest error over the largest
               magnitude of the reference). The dry run compares blockwise
               with XLA's bfloat16 attention instead.
  train        20 steps of schedule `none` of configs/smollm-135m.yaml
               (bfloat16 compute) on random tokens: tokens/s, MFU (causal
               and full attention), HFU, the first and last loss.
  memory       the compiled step's memory on the GPU (XLA's analysis and the
               device's peak at run time) beside the planner's estimate and
               its CPU compilation of the same step (tools/planner.py
               --compile --json, run on the CPU in a subprocess).
  generate     a short greedy generation from the trained weights.
  projection   the same step compiled for this GPU's kind without using it
               (`tools/planner.py --gpu KIND`, on the CPU in a subprocess:
               `jaxpipe.gpu`), its projected step time and memory beside
               what `train` measured and XLA's analysis on the device: the
               projection's error, measured. Skipped, saying why, where the
               device's kind has no target (jaxpipe/gpu/targets) or the
               dry run has no GPU.

Results go to OUT/device_check.json and OUT/device_check.md, rewritten after
every part, so a run stopped early keeps what it finished. A part that would
start after --budget-s seconds is skipped. Exit status: 0 when every part
passed, 1 when one failed, 2 for bad input (no GPU without --dry-run).

The GPU's Python needs jax (a CUDA build), flax, optax, orbax-checkpoint,
chex and pyyaml; nothing here imports grain, the tokenizers' vocabularies or
the embedded corpus (the tokens are random), and nothing reads the network.
XLA's GPU flags are training's defaults for schedule `none`
(`jaxpipe.accel.gpu_xla_flags`), set before JAX starts.

JAX APIs the GPU parts call, each checked in JAX 0.11's source and
documentation (`jax.nn.dot_product_attention`'s `implementation='cudnn'`
and `is_causal`; `jax.jit(...).lower(...).compile()` and the compiled
program's `memory_analysis()` with `argument_size_in_bytes`,
`output_size_in_bytes`, `alias_size_in_bytes`, `temp_size_in_bytes`;
`Device.memory_stats()` with `peak_bytes_in_use` and `bytes_limit`;
`Device.device_kind`; `jax.devices`, `jax.default_backend`,
`jax.block_until_ready`, `jax.value_and_grad`, `jax.random.key`,
`jax.device_put`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Optional

from jaxpipe.cli._common import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "configs/smollm-135m.yaml"
# Largest error over the largest magnitude of the float32 reference. bfloat16
# keeps 8 significant bits (a relative rounding of 2^-9 = 0.2% per value);
# attention's sums of up to 2048 products and the backward's chains of them
# round several times, so the bound allows about ten roundings.
ATTENTION_TOL = 2e-2


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The shapes of one run of the check: the GPU's, or the dry run's tiny ones."""
  attention: tuple[int, int, int, int, int]   # batch, seq, heads, kv heads, head size
  train_steps: int                            # steps run; 2 of them untimed warm-up
  overrides: tuple[str, ...]                  # on top of configs/smollm-135m.yaml
  vocab: int
  new_tokens: int


GPU = Sizes(attention=(8, 2048, 9, 3, 64), train_steps=20, overrides=(), vocab=49152,
            new_tokens=32)
# The dry run: SmolLM-135M's config made tiny, to exercise every path on a CPU fast.
DRY = Sizes(attention=(2, 256, 4, 2, 16), train_steps=3,
            overrides=("model.dim=64", "model.n_layers=2", "model.n_heads=4",
                       "model.n_kv_heads=2", "model.ffn_dim=128", "data.batch_size=4",
                       "data.seq_len=64", "pipeline.microbatches=2"),
            vocab=257, new_tokens=4)


def _args(argv):
  p = Parser(prog="device_check", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="device_check", help="folder for the results (created)")
  p.add_argument("--dry-run", action="store_true",
                 help="on a CPU: tiny shapes, every part but the GPU's own (cuDNN)")
  p.add_argument("--budget-s", type=float, default=420.0,
                 help="skip a part that would start after this many seconds (default 420)")
  return p.parse_args(argv)


def _config(sizes: Sizes):
  """configs/smollm-135m.yaml as the check runs it: `none` on one device, in bfloat16."""
  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(os.path.join(ROOT, CONFIG),
                        ["pipeline.schedule=none", "pipeline.stages=1", "mesh.data=1",
                         f"model.vocab_size={sizes.vocab}", *sizes.overrides])
  return cfg


def _rel_err(x, ref) -> float:
  import numpy as np  # pylint: disable=g-import-not-at-top
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def check_attention(sizes: Sizes, dry_run: bool) -> dict[str, Any]:
  """cuDNN and blockwise attention in bfloat16 (values, q, k, v gradients) against float32 XLA."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from jaxpipe.model import blockwise_attention, cudnn_attention
  b, t, h, kvh, d = sizes.attention
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, kvh, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, kvh, d), jnp.bfloat16)
  w = jax.random.normal(keys[3], (b, t, h, d), jnp.float32)  # a cotangent that weighs every output

  def value_and_grads(fn, dtype):
    def loss(q, k, v):
      out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype))
      return jnp.sum(out.astype(jnp.float32) * w), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads

  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation="xla")
  ref_out, ref_grads = value_and_grads(xla, jnp.float32)
  impls = {"blockwise": blockwise_attention}
  if dry_run:
    impls["xla"] = xla  # the CPU has no cuDNN: XLA's own bfloat16 attention stands in
  else:
    impls["cudnn"] = cudnn_attention
  result: dict[str, Any] = {"shape": f"q {b}x{t}x{h}x{d}, k and v {b}x{t}x{kvh}x{d}, bfloat16",
                            "tolerance": ATTENTION_TOL, "errors": {}}
  for name, fn in impls.items():
    out, grads = value_and_grads(fn, jnp.bfloat16)
    result["errors"][name] = {"out": _rel_err(out, ref_out),
                              **{f"d{n}": _rel_err(g, r) for n, g, r in
                                 zip("qkv", grads, ref_grads)}}
  worst = max(e for errs in result["errors"].values() for e in errs.values())
  result["passed"] = worst <= ATTENTION_TOL
  if not result["passed"]:
    raise AssertionError(f"attention error {worst:.3g} above the tolerance {ATTENTION_TOL:g}: "
                         f"{result['errors']}")
  return result


def check_train(sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
  """Steps of `none` on random tokens: speed, MFU, HFU, loss; keeps the weights for `generate`."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe import accel, bench  # pylint: disable=g-import-not-at-top
  cfg = _config(sizes)
  m = cfg.pipeline.microbatches
  peak = accel.device_peak_tflops(jax.devices()[0].device_kind)
  notes: list[str] = []
  row, params = bench.measure(cfg.model, cfg.optimizer, "none", (1, 1),
                              batch=cfg.data.batch_size, seq=cfg.data.seq_len, microbatches=m,
                              steps=sizes.train_steps - 2, warmup=2, peak=peak,
                              devices=jax.devices()[:1], say=notes.append, keep_params=True)
  state["params"], state["cfg"], state["xla_gib"] = params, cfg, row.xla_gib
  state["row"] = dataclasses.asdict(row)
  return {"config": CONFIG, "overrides": list(sizes.overrides), "steps": sizes.train_steps,
          "batch_shape": f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens, {m} microbatches",
          "notes": notes, **dataclasses.asdict(row)}


def check_memory(sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
  """The compiled step's bytes on this device beside the planner's estimate and CPU compilation."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  cfg = state.get("cfg") or _config(sizes)
  overrides = ["pipeline.schedule=none", "pipeline.stages=1", "mesh.data=1",
               f"model.vocab_size={sizes.vocab}", "data.tokenizer=byte", *sizes.overrides]
  # This clone's jaxpipe first, on the CPU.
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
  env.pop("XLA_FLAGS", None)  # the planner emulates its own CPU devices
  p = subprocess.run([sys.executable, "-m", "jaxpipe.cli.planner", "--config",
                      os.path.join(ROOT, CONFIG), "--compile", "--json", *overrides],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
  if p.returncode != 0:
    raise RuntimeError(f"the planner failed ({p.returncode}): {p.stderr.strip()[-500:]}")
  plan = json.loads(p.stdout)
  memory = accel.device_memory(jax.devices()[:1]) or [{}]
  gib = lambda n: None if n is None else n / 2 ** 30
  return {"planner_estimate_gib": plan["estimate_gib"],
          "planner_xla_cpu_gib": plan["xla_resident_gib"],
          "xla_this_device_gib": state.get("xla_gib"),
          "runtime_peak_gib": gib(memory[0].get("peak_bytes_in_use")),
          "device_limit_gib": gib(memory[0].get("bytes_limit")),
          "schedule": cfg.pipeline.schedule}


def check_generate(sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
  """A short greedy continuation of two prompts from the trained (or fresh) weights."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe import generate, model as model_lib  # pylint: disable=g-import-not-at-top
  cfg = state.get("cfg") or _config(sizes)
  params = state.get("params")
  if params is None:
    params = jax.jit(model_lib.make_model(cfg.model).init)(jax.random.key(0))
  prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
  t0 = time.perf_counter()
  out = generate.generate(cfg.model, params, prompts, max_new_tokens=sizes.new_tokens,
                          temperature=0.0, device=jax.devices()[0])
  seconds = time.perf_counter() - t0
  if [len(o) for o in out] != [sizes.new_tokens] * len(prompts) or not all(
      0 <= t < cfg.model.vocab_size for o in out for t in o):
    raise AssertionError(f"expected {sizes.new_tokens} ids in [0, {cfg.model.vocab_size}) per "
                         f"prompt, got {out}")
  return {"prompts": prompts, "new_tokens": out, "seconds_with_compilation": seconds}


def check_environment(dry_run: bool) -> dict[str, Any]:
  """What ran: versions, backend, device kind and its peak, XLA_FLAGS."""
  from importlib import metadata  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  kind = jax.devices()[0].device_kind
  # jaxlib comes with jax; its version is read from the installed metadata.
  return {"jax": jax.__version__, "jaxlib": metadata.version("jaxlib"),
          "backend": jax.default_backend(), "devices": jax.device_count(), "device_kind": kind,
          "peak_tflops": accel.device_peak_tflops(kind),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "dry_run": dry_run}


def _kind_of(device_kind: str) -> Optional[str]:
  """The `jaxpipe.gpu` kind whose target reports `device_kind`, else None."""
  from jaxpipe import gpu  # pylint: disable=g-import-not-at-top
  return next((name for name, k in gpu.KINDS.items() if k.device_kind == device_kind), None)


def check_projection(sizes: Sizes, state: dict[str, Any], dry_run: bool) -> dict[str, Any]:
  """The train part's step compiled for this GPU's kind on the CPU: projected beside measured."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe import gpu  # pylint: disable=g-import-not-at-top
  missing = gpu.cuda_plugin_missing()
  if missing:
    return {"skipped": missing}
  # The dry run projects an H100 for the code path; a CPU's times are not compared with it.
  device_kind = "NVIDIA H100 80GB HBM3" if dry_run else jax.devices()[0].device_kind
  kind = _kind_of(device_kind)
  if kind is None:
    return {"skipped": f"no GPU target describes a {device_kind} (jaxpipe/gpu/targets)"}
  overrides = ["pipeline.schedule=none", "pipeline.stages=1", "mesh.data=1",
               f"model.vocab_size={sizes.vocab}", "data.tokenizer=byte", *sizes.overrides]
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
  env.pop("XLA_FLAGS", None)  # the planner sets its own
  p = subprocess.run([sys.executable, "-m", "jaxpipe.cli.planner", "--config",
                      os.path.join(ROOT, CONFIG), "--gpu", kind, "--json", *overrides],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
  if p.returncode != 0:
    raise RuntimeError(f"the planner failed ({p.returncode}): {p.stderr.strip()[-500:]}")
  g = json.loads(p.stdout)["gpu"]
  measured_s = None if dry_run else (state.get("row") or {}).get("step_s")
  measured_gib = None if dry_run else state.get("xla_gib")
  ratio = lambda a, b: None if a is None or b is None or not b else a / b
  return {"kind": kind, "device_kind": device_kind,
          "projected_step_s": g["projected_step_s"], "measured_step_s": measured_s,
          "measured_over_projected": ratio(measured_s, g["projected_step_s"]),
          "projected_mfu": g["projected_mfu"],
          "projected_resident_gib": g["resident_gib"], "measured_xla_gib": measured_gib,
          "attention": g["attention"], "compile_s": g["compile_s"]}


def _markdown(report: dict[str, Any]) -> str:
  """The report as Markdown: one section per part."""
  lines = [f"# jaxpipe device check ({report['started']})", "",
           f"command: `{report['command']}`", ""]
  for name, part in report["parts"].items():
    lines.append(f"## {name}: {part['status']} ({part.get('seconds', 0):.1f} s)")
    lines.append("")
    for key, value in part.items():
      if key in ("status", "seconds", "traceback"):
        continue
      lines.append(f"- {key}: {json.dumps(value) if not isinstance(value, str) else value}")
    lines.append("")
  return "\n".join(lines)


def _write(out: str, report: dict[str, Any]) -> None:
  with open(os.path.join(out, "device_check.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
  with open(os.path.join(out, "device_check.md"), "w") as f:
    f.write(_markdown(report) + "\n")


def run_parts(parts: list[tuple[str, Callable[[], dict[str, Any]]]], out: str,
              report: dict[str, Any], budget_s: float,
              say: Callable[[str], None]) -> bool:
  """Runs each part under its own guard, writing the report after each; True if all passed.

  A part that raises is recorded as failed with its error in one line and
  its traceback; the next part runs anyway. A part that would start after
  `budget_s` seconds is recorded as skipped.
  """
  t_start = time.perf_counter()
  ok = True
  for name, fn in parts:
    if time.perf_counter() - t_start > budget_s:
      report["parts"][name] = {"status": "skipped", "why": f"past the {budget_s:g} s budget"}
      ok = False
      _write(out, report)
      continue
    say(f"device_check: {name} ...")
    t0 = time.perf_counter()
    try:
      result = {"status": "ok", **fn()}
    except Exception as e:  # pylint: disable=broad-exception-caught
      # Any failure of one part is its result; the others must still run.
      result = {"status": "failed", "error": " ".join(f"{type(e).__name__}: {e}".split())[:1000],
                "traceback": traceback.format_exc()}
      ok = False
    result["seconds"] = time.perf_counter() - t0
    report["parts"][name] = result
    say(f"device_check: {name} {result['status']} ({result['seconds']:.1f} s)")
    _write(out, report)
  return ok


def main(argv: Optional[list[str]] = None) -> int:
  """Runs the check's parts and writes OUT/device_check.{json,md}; the exit status."""
  args = _args(argv)
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  if not args.dry_run and accel.gpu_expected():
    # Training's XLA flags for schedule none, before JAX starts.
    os.environ["XLA_FLAGS"] = accel.merge_xla_flags(
        os.environ.get("XLA_FLAGS", ""), accel.gpu_xla_flags(deterministic=True, pipelined=False))
  import jax  # pylint: disable=g-import-not-at-top
  if not args.dry_run and jax.default_backend() != "gpu":
    print(f"device_check: no GPU found (JAX's backend is {jax.default_backend()}); run it on a "
          "machine with an NVIDIA GPU, or with --dry-run", file=sys.stderr)
    return 2
  if args.budget_s <= 0:
    print(f"device_check: --budget-s must be > 0, got {args.budget_s:g}", file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  sizes = DRY if args.dry_run else GPU
  state: dict[str, Any] = {}
  report = {"command": " ".join(["python", "tools/device_check.py", *(argv or sys.argv[1:])]),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "attention_tolerance": ATTENTION_TOL, "parts": {}}
  parts = [("environment", lambda: check_environment(args.dry_run)),
           ("attention", lambda: check_attention(sizes, args.dry_run)),
           ("train", lambda: check_train(sizes, state)),
           ("memory", lambda: check_memory(sizes, state)),
           ("generate", lambda: check_generate(sizes, state)),
           ("projection", lambda: check_projection(sizes, state, args.dry_run))]
  say = lambda msg: print(msg, file=sys.stderr, flush=True)
  ok = run_parts(parts, args.out, report, args.budget_s, say)
  say(f"device_check: results in {os.path.join(args.out, 'device_check.md')} and .json")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
