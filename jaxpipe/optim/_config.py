"""The optimizer's config section: `OptimizerConfig` (`optimizer:` in a run's YAML).

Plain dataclasses, no JAX: `jaxpipe.config` composes this section with the
others (its `validate` calls this module's), and `make_optimizer` builds the
optax chain from it.

Layout. Each optimizer's own hyperparameters are one frozen dataclass, a
subsection named after it (`optimizer.muon.momentum`, `optimizer.lion.b1`),
as levanter types its optimizer configs; what several optimizers read stays
flat in `optimizer`: the name, the rate and its schedule, the decay, the
betas and eps of AdamW (and of the AdamW groups), the clip and the knobs of
the delay and its corrections. Unlike levanter's registry selected by
`type:`, every section is present whatever `optimizer.name` picks: a run's
config.yaml records every setting, and `--help` and overrides see one fixed
tree of keys.

Keys that were flat before the sections (`optimizer.mars_gamma`, ...) are
refused where a user gives them, naming the new key (`MOVED`); a config that
an earlier run saved with them is read in today's keys (`saved_section`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, Mapping

from jaxpipe.errors import check_config as _check

__all__ = ["OptimizerConfig", "MuonConfig", "NorMuonConfig", "MarsConfig", "LionConfig",
           "AdanConfig", "SoapConfig", "SgdConfig", "OptimizerName", "LrSchedule", "AdanForm",
           "NsCoeffs", "OPTIMIZERS", "LR_SCHEDULES", "ADAN_FORMS", "NS_PRESETS", "MOVED",
           "saved_section", "validate"]

OptimizerName = Literal["adamw", "muon", "lion", "adan", "sgd", "mars", "normuon", "soap"]
LrSchedule = Literal["constant", "cosine", "wsd"]
# Adan's update: the paper's, or optax.adan's (`jaxpipe.optim.adan`'s `form`).
AdanForm = Literal["paper", "optax"]
# Muon's Newton-Schulz coefficients by name (`jaxpipe.optim.scale_by_muon`'s `ns_coeffs`).
NsCoeffs = Literal["jordan", "polar_express"]

OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)
LR_SCHEDULES: tuple[str, ...] = typing.get_args(LrSchedule)
ADAN_FORMS: tuple[str, ...] = typing.get_args(AdanForm)
NS_PRESETS: tuple[str, ...] = typing.get_args(NsCoeffs)


@dataclasses.dataclass(frozen=True)
class MuonConfig:
  """`optimizer.muon`: Muon's orthogonalised momentum on the hidden matrices.

  NorMuon reads this section too: its direction is Muon's, before the
  per-neuron normalisation of `optimizer.normuon`.
  """
  momentum: float = 0.95         # momentum beta; muon and normuon read this section
  nesterov: bool = True          # Nesterov momentum
  ns_steps: int = 5              # Newton-Schulz iterations
  ns_coeffs: NsCoeffs = "jordan" # Newton-Schulz quintics (polar_express: one per step)


@dataclasses.dataclass(frozen=True)
class NorMuonConfig:
  """`optimizer.normuon`: what NorMuon adds to Muon (whose `optimizer.muon` it reads)."""
  b2: float = 0.95               # decay of the per-output-neuron second moment


@dataclasses.dataclass(frozen=True)
class MarsConfig:
  """`optimizer.mars`: MARS on the hidden matrices (`optimizer.b1`, `b2`: its AdamW group)."""
  gamma: float = 0.025           # c = g + gamma * b1/(1-b1) * (g - g_prev)
  b1: float = 0.95               # first-moment decay on the matrices
  b2: float = 0.99               # second-moment decay on the matrices


@dataclasses.dataclass(frozen=True)
class LionConfig:
  """`optimizer.lion`: Lion's two betas, whose meaning differs from Adam's."""
  b1: float = 0.9                # interpolation of the update direction (Chen et al.: 0.9)
  b2: float = 0.99               # momentum decay (Chen et al.: 0.99)


@dataclasses.dataclass(frozen=True)
class AdanConfig:
  """`optimizer.adan`: Adan's three decays, in optax's convention: b = 1 - the paper's beta."""
  b1: float = 0.98               # first moment (the paper's beta1 = 0.02)
  b2: float = 0.92               # moment of the gradient difference (the paper's beta2 = 0.08)
  b3: float = 0.99               # second moment (the paper's beta3 = 0.01)
  # paper (the Adan paper's update) | optax (optax.adan: difference weighted 1 - b2)
  form: AdanForm = "paper"


@dataclasses.dataclass(frozen=True)
class SoapConfig:
  """`optimizer.soap`: SOAP's preconditioner (`optimizer.b1`, `b2`, `eps`: its Adam)."""
  precondition_frequency: int = 10  # steps between eigenbasis refreshes (paper: 10)
  shampoo_beta: float = 0.95     # decay of its factors L, R (paper: = b2, 0.95)
  max_precond_dim: int = 10000   # a matrix side longer than this is not rotated (paper: 10000)


@dataclasses.dataclass(frozen=True)
class SgdConfig:
  """`optimizer.sgd`: heavy-ball momentum.

  The defaults are those SGD had when it read Muon's keys (0.95, Nesterov),
  so a config that names neither runs as before.
  """
  momentum: float = 0.95         # momentum decay
  nesterov: bool = True          # Nesterov momentum


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """`optimizer`: which optimizer, its rate and schedule, what the optimizers share.

  One subsection per optimizer holds the hyperparameters only it reads
  (NorMuon reads `muon` and `normuon`); the flat keys are read by several.

  `adam_lr` is flat, not in `muon`: muon, normuon and mars all read it, as
  the rate of the AdamW group (embeddings, head, norms, biases) that each of
  them keeps beside its matrices, and that group's b1, b2 and eps are flat
  too. A copy in each of their sections would be three keys for one knob,
  and `optimizer.name=mars` would silently ignore a rate set under `muon`.
  """
  name: OptimizerName = "adamw"  # muon, normuon and mars keep an AdamW group
  lr: float = 3e-3               # peak learning rate (Muon: of the hidden matrices)
  adam_lr: float = 0.0           # muon, normuon, mars: peak rate of their AdamW group; 0 = lr
  weight_decay: float = 0.1      # decoupled; never applied to norms and biases
  b1: float = 0.9                # first-moment decay: adamw, soap, the AdamW groups
  b2: float = 0.95               # second-moment decay: adamw, soap, the AdamW groups
  eps: float = 1e-8              # adamw, soap, adan, the AdamW groups
  schedule: LrSchedule = "cosine"  # learning rate; wsd = warmup-stable-decay
  warmup_steps: int = 0
  min_lr_ratio: float = 0.1      # final lr of cosine / wsd as a fraction of lr
  decay_fraction: float = 0.2    # wsd: share of the steps spent decaying
  clip_norm: float = 1.0         # global gradient-norm clip; 0 = off
  delay: int = 0                 # simulated gradient delay in steps (schedule=none only)
  error_feedback: float = 0.0    # correction coefficient c; 0 = off
  ef_dtype: str = ""             # dtype of the correction buffer; "" = the parameters'
  # horizon s: gradients at w + s * (last update) (schedule none only); 0 = off
  weight_prediction: float = 0.0
  muon: MuonConfig = dataclasses.field(default_factory=MuonConfig)
  normuon: NorMuonConfig = dataclasses.field(default_factory=NorMuonConfig)
  mars: MarsConfig = dataclasses.field(default_factory=MarsConfig)
  lion: LionConfig = dataclasses.field(default_factory=LionConfig)
  adan: AdanConfig = dataclasses.field(default_factory=AdanConfig)
  soap: SoapConfig = dataclasses.field(default_factory=SoapConfig)
  sgd: SgdConfig = dataclasses.field(default_factory=SgdConfig)


# The flat keys of the section before it had subsections, and where each
# went (relative to `optimizer`). `momentum` and `nesterov` served Muon and
# SGD alike; each of the two has them in its own section now.
MOVED: dict[str, tuple[str, ...]] = {
    "momentum": ("muon.momentum", "sgd.momentum"),
    "nesterov": ("muon.nesterov", "sgd.nesterov"),
    "ns_steps": ("muon.ns_steps",),
    "ns_coeffs": ("muon.ns_coeffs",),
    "normuon_b2": ("normuon.b2",),
    "mars_gamma": ("mars.gamma",),
    "mars_b1": ("mars.b1",),
    "mars_b2": ("mars.b2",),
    "lion_b1": ("lion.b1",),
    "lion_b2": ("lion.b2",),
    "adan_b1": ("adan.b1",),
    "adan_b2": ("adan.b2",),
    "adan_b3": ("adan.b3",),
    "adan_form": ("adan.form",),
    "precondition_frequency": ("soap.precondition_frequency",),
    "shampoo_beta": ("soap.shampoo_beta",),
    "max_precond_dim": ("soap.max_precond_dim",),
}


def saved_section(section: Mapping[str, Any]) -> dict[str, Any]:
  """An `optimizer` section as a run saved it, with the flat keys of `MOVED` in their sections.

  For configs that a run wrote (its config.yaml, a checkpoint's meta), never
  for a user's, whose old keys are refused. A key that moved to several
  sections (`momentum`, `nesterov`) goes to the section of the run's own
  optimizer where it has one (`sgd`), else to the first (`muon`, which
  NorMuon reads too): that is the value the run used, and the one a resume
  of it sets. A section the saved config has already is kept; a moved key
  fills it only where it lacks the key. The result is a new dict.
  """
  out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in section.items()}
  name = out.get("name", OptimizerConfig.name)
  for old, targets in MOVED.items():
    if old not in out:
      continue
    value = out.pop(old)
    target = next((t for t in targets if t.split(".")[0] == name), targets[0])
    sub, key = target.split(".")
    out.setdefault(sub, {}).setdefault(key, value)
  return out


def validate(o: OptimizerConfig) -> None:
  """Checks optimizer.*: rates, decays, the sections' betas, the correction knobs.

  Raises ConfigError (one line, naming the key).

  Each choice (name, schedule, muon.ns_coeffs, adan.form) is a `Literal`,
  checked where the config is read, so not again here. `ef_dtype` names one
  of the model's dtypes, which `jaxpipe.config` checks.
  """
  _check(o.lr > 0, f"optimizer.lr must be > 0, got {o.lr}")
  _check(o.delay >= 0, f"optimizer.delay must be >= 0, got {o.delay}")
  _check(o.error_feedback >= 0, f"optimizer.error_feedback must be >= 0, got {o.error_feedback}")
  _check(o.weight_prediction >= 0,
         f"optimizer.weight_prediction must be >= 0, got {o.weight_prediction}")
  _check(0.0 <= o.min_lr_ratio <= 1.0,
         f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
  _check(0.0 <= o.decay_fraction <= 1.0,
         f"optimizer.decay_fraction must be in [0, 1], got {o.decay_fraction}")
  _check(o.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {o.warmup_steps}")
  _check(o.clip_norm >= 0, f"optimizer.clip_norm must be >= 0, got {o.clip_norm}")
  # A negative decoupled decay grows the weights every step instead of shrinking them.
  _check(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
  decays = {"lion": ("b1", "b2"), "adan": ("b1", "b2", "b3"), "normuon": ("b2",),
            "mars": ("b1", "b2"), "soap": ("shampoo_beta",)}
  for section, keys in decays.items():
    for key in keys:
      value = getattr(getattr(o, section), key)
      _check(0.0 <= value < 1.0, f"optimizer.{section}.{key} must be in [0, 1), got {value}")
  _check(o.mars.gamma >= 0, f"optimizer.mars.gamma must be >= 0, got {o.mars.gamma}")
  _check(o.soap.precondition_frequency >= 1,
         f"optimizer.soap.precondition_frequency must be >= 1, "
         f"got {o.soap.precondition_frequency}")
  _check(o.soap.max_precond_dim >= 0,
         f"optimizer.soap.max_precond_dim must be >= 0, got {o.soap.max_precond_dim}")
