"""Optimizers for asynchronous pipeline-parallel training, as optax transforms.

Everything here is a plain `optax.GradientTransformation`: it jits, keeps bf16
updates bf16, and composes with `optax.chain`, `optax.partition`,
`optax.inject_hyperparams` and `optax.MultiSteps`. Nothing here knows about
pipelines, so other JAX projects can use it on its own.

- `muon`, `adamw`, `lion`, `adan`, `sgd`: optimizers with one grouping
  convention (`param_labels`, `weight_decay_mask`): Muon on hidden matrices
  (stacked ones included), AdamW elsewhere, no decay on norms and biases;
  `scale_by_muon` is Muon's direction and scale alone.
- `mars`, `normuon`: MARS-AdamW (variance-reduced gradients) and NorMuon
  (Muon with a per-neuron second moment); `muon(ns_coeffs="polar_express")`
  takes Polar Express's per-step Newton-Schulz coefficients.
- `soap`: Adam in the eigenbasis of Shampoo's factors on hidden matrices.
- `delay(inner, steps)`: the stale gradients of an asynchronous pipeline
  (PipeDream-2BW: one step) reproduced on one device.
- `error_feedback(inner, coeff)`: the optimizer-agnostic correction for them.
- `weight_prediction(inner, steps)` with `predicted_params(params, state)`:
  the other correction, gradients taken at extrapolated weights.
- `learning_rate_schedule(cfg, total_steps)` and `make_optimizer(cfg, total_steps)`:
  the whole chain from a config, `delay(error_feedback(clip + optimizer))`.
- `OptimizerConfig`: that config (`optimizer:` in a run's YAML), one
  subsection per optimizer (`MuonConfig`, `LionConfig`, ...). It is plain
  dataclasses: importing it, or this package, does not start JAX; the
  optimizers load on first use of their names.

Reference: Zmushko et al., "One-Step Gradient Delay is Not a Barrier for
Large-Scale Asynchronous Pipeline Parallel LLM Pretraining", arXiv 2606.30634,
2026.
"""

import importlib

from jaxpipe.optim._config import (ADAN_FORMS, LR_SCHEDULES, MOVED, NS_PRESETS, OPTIMIZERS,
                                   AdanConfig, AdanForm, LionConfig, LrSchedule, MarsConfig,
                                   MuonConfig, NorMuonConfig, NsCoeffs, OptimizerConfig,
                                   OptimizerName, SgdConfig, SoapConfig, saved_section, validate)

_LAZY = {
    "make_optimizer": "_build", "learning_rate_schedule": "_build",
    "adan": "_adan", "AdanState": "_adan", "scale_by_adan": "_adan",
    "EMBEDDING_NAMES": "_grouping", "HEAD_NAMES": "_grouping", "param_kinds": "_grouping",
    "param_labels": "_grouping", "ROUTER_NAMES": "_grouping", "VECTOR_NAMES": "_grouping",
    "weight_decay_mask": "_grouping",
    "mars": "_mars", "mars_labels": "_mars", "scale_by_mars": "_mars",
    "ScaleByMarsState": "_mars",
    "normuon": "_normuon", "scale_by_neuron_rms": "_normuon",
    "ScaleByNeuronRmsState": "_normuon",
    "muon": "_muon", "NS_COEFFS": "_muon", "POLAR_EXPRESS_COEFFS": "_muon",
    "scale_by_muon": "_muon",
    "adamw": "_optimizers", "lion": "_optimizers", "sgd": "_optimizers",
    "predicted_params": "_prediction", "PredictionState": "_prediction",
    "weight_prediction": "_prediction",
    "scale_by_soap": "_soap", "ScaleBySoapState": "_soap", "soap": "_soap",
    "delay": "_wrappers", "DelayState": "_wrappers", "error_feedback": "_wrappers",
    "ErrorFeedbackState": "_wrappers",
}

__all__ = sorted([
    "ADAN_FORMS", "LR_SCHEDULES", "MOVED", "NS_PRESETS", "OPTIMIZERS", "AdanConfig",
    "AdanForm", "LionConfig", "LrSchedule", "MarsConfig", "MuonConfig", "NorMuonConfig",
    "NsCoeffs", "OptimizerConfig", "OptimizerName", "SgdConfig", "SoapConfig",
    "saved_section", "validate", *_LAZY])


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f"jaxpipe.optim.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'jaxpipe.optim' has no attribute {name!r}")
