"""From the `optimizer` section of a config to one optax transform."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax

from jaxpipe.optim import _adan
from jaxpipe.optim import _mars
from jaxpipe.optim import _muon
from jaxpipe.optim import _normuon
from jaxpipe.optim import _optimizers
from jaxpipe.optim import _prediction
from jaxpipe.optim import _soap
from jaxpipe.optim import _wrappers
from jaxpipe.optim._config import OptimizerConfig

__all__ = ["make_optimizer", "learning_rate_schedule"]

WSD_SHAPES = ("1-sqrt", "linear")


def _one_minus_sqrt(init_value: float, end_value: float,
                    transition_steps: int) -> optax.Schedule:
  def schedule(count):
    frac = jnp.clip(count / transition_steps, 0.0, 1.0)
    return end_value + (init_value - end_value) * (1.0 - jnp.sqrt(frac))
  return schedule


def learning_rate_schedule(
    cfg: OptimizerConfig, total_steps: int, *, wsd_shape: str = "1-sqrt",
) -> optax.Schedule:
  r"""The learning rate as a function of the optimizer's update count.

  With peak `lr`, floor `lr_min = min_lr_ratio * lr`, warmup `w` and total
  `T` updates (count k from 0):

  - warmup (every schedule, if `w > 0`): `lr * k / w` for k < w, so the first
    update has rate 0 and the peak is reached at k = w (optax's convention);
  - `constant`: `lr` after warmup;
  - `cosine`: `lr_min + (lr - lr_min) (1 + cos(pi (k - w) / (T - w))) / 2`
    for w <= k <= T, then `lr_min`;
  - `wsd` (warmup-stable-decay): `lr` until `s = T - d` with
    `d = round(decay_fraction * T)` decay steps (but not before warmup ends),
    then `lr_min + (lr - lr_min) (1 - sqrt((k - s) / d))` up to T, then
    `lr_min`. The 1-sqrt cooldown is the choice: Hägele et al. (2024) found it
    better than a linear one of the same length; `wsd_shape="linear"` gives
    the linear one.

  Under `delay` the optimizer is first called `cfg.delay` steps late, so its
  count k is the training step minus the delay.

  Args:
    cfg: an `OptimizerConfig` (`lr`, `schedule`, `warmup_steps`,
      `min_lr_ratio`, `decay_fraction` are read).
    total_steps: T, the number of updates the schedule spans.
    wsd_shape: `"1-sqrt"` or `"linear"`, the shape of the WSD cooldown.

  Returns:
    An `optax.Schedule`; it jits (the count may be traced).

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026

    Hägele et al., `Scaling Laws and Compute-Optimal Training Beyond Fixed
    Training Durations <https://arxiv.org/abs/2405.18392>`_, 2024
  """
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps}")
  if wsd_shape not in WSD_SHAPES:
    raise ValueError(
        f"wsd_shape must be one of {WSD_SHAPES}, got {wsd_shape!r}")
  peak = float(cfg.lr)
  floor = cfg.min_lr_ratio * peak
  warmup = int(cfg.warmup_steps)
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=floor)

  pieces, boundaries = [], []
  if warmup > 0:
    pieces.append(optax.linear_schedule(0.0, peak, warmup))
    boundaries.append(warmup)
  if cfg.schedule == "constant":
    pieces.append(optax.constant_schedule(peak))
  elif cfg.schedule == "wsd":
    decay_steps = round(cfg.decay_fraction * total_steps)
    start = max(warmup, total_steps - decay_steps)
    decay_steps = total_steps - start
    pieces.append(optax.constant_schedule(peak))
    if decay_steps > 0:
      boundaries.append(start)
      if wsd_shape == "linear":
        pieces.append(optax.linear_schedule(peak, floor, decay_steps))
      else:
        pieces.append(_one_minus_sqrt(peak, floor, decay_steps))
  else:
    raise ValueError(f"unknown learning-rate schedule {cfg.schedule!r}; "
                     "expected constant, cosine or wsd")
  if len(pieces) == 1:
    return pieces[0]
  return optax.join_schedules(pieces, boundaries)


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int,
) -> optax.GradientTransformation:
  r"""The whole optimizer of a run, from the `optimizer` section of a config.

  Composition (innermost first):

  .. math::
    \mathrm{delay}_{d}\Big(\mathrm{weight\_prediction}_{s}\big(\mathrm{error\_feedback}_{c}(
      \mathrm{clip}_{\tau} \circ \mathrm{optimizer}(\mathrm{schedule}))\big)\Big)

  - schedule: `learning_rate_schedule(cfg, total_steps)`; for Muon, AdamW's
    schedule has the same shape with peak `cfg.adam_lr` (0 = `cfg.lr`);
  - clip: `optax.clip_by_global_norm(cfg.clip_norm)` over the whole tree
    (0 = off);
  - optimizer by `cfg.name`, each with its own section: `adamw` and the
    AdamW groups use the flat `b1`, `b2`, `eps`; `muon` uses `cfg.muon`
    (`momentum`, `nesterov`, `ns_steps`, `ns_coeffs`); `normuon` that and
    `cfg.normuon.b2`; `mars` uses `cfg.mars` (`gamma`, `b1`, `b2`) on its
    matrices (muon, normuon and mars take `adam_lr` for their AdamW group);
    `sgd` uses `cfg.sgd` (`momentum`, `nesterov`); `soap` uses `b1`, `b2`,
    `eps` (both its groups, one rate) and `cfg.soap`
    (`precondition_frequency`, `shampoo_beta`, `max_precond_dim`); `lion`
    takes `cfg.lion` (`b1`, `b2`) and `adan` `cfg.adan` (`b1`, `b2`, `b3`,
    whose meaning differs from Adam's, and `form`) and `eps`. All take
    `weight_decay` with the default decay mask;
  - error feedback with c = `cfg.error_feedback` (0 = off), its buffer in
    `cfg.ef_dtype` ("" = the params' dtype);
  - weight prediction with horizon s = `cfg.weight_prediction` (0 = off):
    the updates pass unchanged, and the caller takes the gradient at
    `predicted_params(params, state)` (the trainer does, for schedule none);
  - delay of `cfg.delay` steps (0 = off).

  Error feedback sits inside the delay so that its first real update is
  uncorrected, as in a PipeDream-2BW pipeline, which first calls the optimizer
  when a delayed gradient exists (see `delay`). With `pipeline.schedule=2bw`
  the pipeline supplies the delay and `cfg.delay` is 0.

  No host callbacks and no Python branching on values, so the result jits
  and runs on sharded params (`NamedSharding`) under `jax.jit`.

  State: nested states of the pieces above. Memory: the optimizer's, plus one
  parameter-sized buffer for error feedback and `cfg.delay` gradient buffers.

  Args:
    cfg: an `OptimizerConfig` (`jaxpipe.config`'s `optimizer` section).
    total_steps: updates the learning-rate schedule spans (`run.steps`).

  Returns:
    An `optax.GradientTransformation`.

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026
  """
  lr = learning_rate_schedule(cfg, total_steps)
  wd = cfg.weight_decay
  if cfg.name == "adamw":
    opt = _optimizers.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                            weight_decay=wd)
  elif cfg.name in ("muon", "normuon", "mars"):
    adam_lr = lr
    if cfg.adam_lr:
      adam_lr = learning_rate_schedule(
          dataclasses.replace(cfg, lr=cfg.adam_lr), total_steps)
    if cfg.name == "mars":
      opt = _mars.mars(
          lr, adam_learning_rate=adam_lr, gamma=cfg.mars.gamma,
          b1=cfg.mars.b1, b2=cfg.mars.b2, adam_b1=cfg.b1, adam_b2=cfg.b2,
          eps=cfg.eps, weight_decay=wd)
    else:
      m = cfg.muon
      shared = dict(
          adam_learning_rate=adam_lr, momentum=m.momentum,
          nesterov=m.nesterov, ns_steps=m.ns_steps,
          ns_coeffs=m.ns_coeffs, weight_decay=wd, b1=cfg.b1, b2=cfg.b2,
          eps=cfg.eps)
      if cfg.name == "normuon":
        opt = _normuon.normuon(lr, neuron_b2=cfg.normuon.b2, **shared)
      else:
        opt = _muon.muon(lr, **shared)
  elif cfg.name == "soap":
    opt = _soap.soap(
        lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd,
        shampoo_beta=cfg.soap.shampoo_beta,
        precondition_frequency=cfg.soap.precondition_frequency,
        max_precond_dim=cfg.soap.max_precond_dim)
  elif cfg.name == "lion":
    opt = _optimizers.lion(lr, b1=cfg.lion.b1, b2=cfg.lion.b2, weight_decay=wd)
  elif cfg.name == "adan":
    opt = _adan.adan(lr, b1=cfg.adan.b1, b2=cfg.adan.b2, b3=cfg.adan.b3, eps=cfg.eps,
                     weight_decay=wd, form=cfg.adan.form)
  elif cfg.name == "sgd":
    opt = _optimizers.sgd(lr, momentum=cfg.sgd.momentum, nesterov=cfg.sgd.nesterov,
                          weight_decay=wd)
  else:
    raise ValueError(f"unknown optimizer {cfg.name!r}; expected adamw, muon, "
                     "normuon, mars, soap, lion, adan or sgd")
  if cfg.clip_norm > 0:
    opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
  if cfg.error_feedback > 0:
    opt = _wrappers.error_feedback(
        opt, cfg.error_feedback, buffer_dtype=cfg.ef_dtype or None)
  if cfg.weight_prediction > 0:
    opt = _prediction.weight_prediction(opt, cfg.weight_prediction)
  if cfg.delay > 0:
    opt = _wrappers.delay(opt, cfg.delay)
  return opt
