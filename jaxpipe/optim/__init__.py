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

Reference: Zmushko et al., "One-Step Gradient Delay is Not a Barrier for
Large-Scale Asynchronous Pipeline Parallel LLM Pretraining", arXiv 2606.30634,
2026.
"""

from jaxpipe.optim._build import make_optimizer
from jaxpipe.optim._build import learning_rate_schedule
from jaxpipe.optim._adan import adan
from jaxpipe.optim._adan import AdanState
from jaxpipe.optim._adan import scale_by_adan
from jaxpipe.optim._grouping import EMBEDDING_NAMES
from jaxpipe.optim._grouping import HEAD_NAMES
from jaxpipe.optim._grouping import param_kinds
from jaxpipe.optim._grouping import param_labels
from jaxpipe.optim._grouping import ROUTER_NAMES
from jaxpipe.optim._grouping import VECTOR_NAMES
from jaxpipe.optim._grouping import weight_decay_mask
from jaxpipe.optim._mars import mars
from jaxpipe.optim._mars import mars_labels
from jaxpipe.optim._mars import scale_by_mars
from jaxpipe.optim._mars import ScaleByMarsState
from jaxpipe.optim._muon import muon
from jaxpipe.optim._muon import NS_COEFFS
from jaxpipe.optim._muon import POLAR_EXPRESS_COEFFS
from jaxpipe.optim._muon import scale_by_muon
from jaxpipe.optim._normuon import normuon
from jaxpipe.optim._normuon import scale_by_neuron_rms
from jaxpipe.optim._normuon import ScaleByNeuronRmsState
from jaxpipe.optim._optimizers import adamw
from jaxpipe.optim._optimizers import lion
from jaxpipe.optim._optimizers import sgd
from jaxpipe.optim._prediction import predicted_params
from jaxpipe.optim._prediction import PredictionState
from jaxpipe.optim._prediction import weight_prediction
from jaxpipe.optim._soap import scale_by_soap
from jaxpipe.optim._soap import ScaleBySoapState
from jaxpipe.optim._soap import soap
from jaxpipe.optim._wrappers import delay
from jaxpipe.optim._wrappers import DelayState
from jaxpipe.optim._wrappers import error_feedback
from jaxpipe.optim._wrappers import ErrorFeedbackState

__all__ = [
    "AdanState",
    "DelayState",
    "EMBEDDING_NAMES",
    "ErrorFeedbackState",
    "HEAD_NAMES",
    "NS_COEFFS",
    "POLAR_EXPRESS_COEFFS",
    "PredictionState",
    "ROUTER_NAMES",
    "ScaleByMarsState",
    "ScaleByNeuronRmsState",
    "ScaleBySoapState",
    "VECTOR_NAMES",
    "adamw",
    "adan",
    "delay",
    "error_feedback",
    "learning_rate_schedule",
    "lion",
    "make_optimizer",
    "mars",
    "mars_labels",
    "muon",
    "normuon",
    "param_kinds",
    "param_labels",
    "predicted_params",
    "scale_by_adan",
    "scale_by_mars",
    "scale_by_muon",
    "scale_by_neuron_rms",
    "scale_by_soap",
    "sgd",
    "soap",
    "weight_decay_mask",
    "weight_prediction",
]
