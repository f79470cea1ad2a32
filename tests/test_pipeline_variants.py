"""Pipeline variants against one-device references: model, optimizer and bfloat16.

On an emulated 8-device CPU mesh (`conftest.py`), in float32 unless said:
- tied embeddings, remat, a gradient clip that binds and a vocabulary that S
  does not divide, each against one device;
- bfloat16 compute against one device in bfloat16, to a derived tolerance,
  and a check that the tolerance tells a wrong run apart.

"Match" is `_pipeline_util.assert_runs_match` (as in test_pipeline.py).
"""

import dataclasses

import jax
import numpy as np
import pytest

from tests import _pipeline_util as util
from tests._pipeline_util import assert_runs_match, run

each_stash = pytest.mark.parametrize("stash", util.STASHES)


# --- model and optimizer variants --------------------------------------------


def _leaf(tree, path):
  """The leaf of a nested dict at a '/'-separated path."""
  for key in path.split("/"):
    tree = tree[key]
  return np.asarray(tree)


TIED = util.config(tie_embeddings=True)
# (schedule, (S, D, M), stash): a flushed schedule with data 2 for both
# stashes, and 2bw, whose embedding (batch k) and head (batch k-1) use the
# one shared matrix at different versions within a tick.
TIED_CASES = [("1f1b", (2, 2, 3), "residuals"), ("2bw", (2, 1, 2), "residuals")]


@pytest.mark.parametrize("schedule,shape,stash", TIED_CASES,
                         ids=[f"{c}-{util.shape_id(x)}-{st}" for c, x, st in TIED_CASES])
def test_tied_embeddings_match_one_device(schedule, shape, stash):
  """With the head tied to the embedding, each stage's vocabulary slice of the one matrix
  collects both gradients (lookup and logits) and trains as on one device.
  """
  s, d, m = shape
  got = run(schedule, s, d, m, "adamw", stash=stash, cfg=TIED)
  want = run("none", 1, 1, m, "adamw", delay=int(schedule == "2bw"), cfg=TIED)
  assert "out" not in got.params["head"]
  assert_runs_match(got, want)


@each_stash
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_matches_one_device(remat, stash):
  """model.remat decides what a stage's residuals hold, not what it computes.

  Compared with the reference without remat: rematerialisation recomputes
  the same float32 operations, so the numbers must not change.
  """
  got = run("1f1b", 2, 1, 2, "adamw", stash=stash, cfg=util.config(remat=remat))
  assert_runs_match(got, run("none", 1, 1, 2, "adamw"))


# Below every gradient norm of these runs (about 0.8), so the clip binds at every step.
CLIP = 0.1


@each_stash
def test_clipped_gradients_match_one_device(stash):
  """optax.clip_by_global_norm sees the pipeline's stage- and vocabulary-sharded
  gradients as the whole tree: the clipped pipeline trains as the clipped one device.

  The clip binds (every step's gradient norm is above it) and matters (the
  unclipped reference ends elsewhere, far beyond the tolerance).
  """
  got = run("1f1b", 4, 2, 4, "adamw", stash=stash, clip=CLIP)
  want = run("none", 1, 1, 4, "adamw", clip=CLIP)
  assert_runs_match(got, want)
  assert np.all(got.grad_norms > 2 * CLIP) and np.all(want.grad_norms > 2 * CLIP)
  np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)
  assert util.max_diff(want.params, run("none", 1, 1, 4, "adamw").params) > 1e-4


ODD_VOCAB = util.config(vocab_size=63)
# 63 entries over S=2 (two slices of 32, one padding column) and S=4 (four
# of 16, one padding column), both stashes at S=2; the same reference (M=4).
ODD_VOCAB_CASES = [("1f1b", (2, 1, 4), "inputs"), ("gpipe", (4, 2, 4), "residuals")]


@pytest.mark.parametrize("schedule,shape,stash", ODD_VOCAB_CASES,
                         ids=[f"{c}-{util.shape_id(x)}-{st}" for c, x, st in ODD_VOCAB_CASES])
def test_padded_vocabulary_matches_one_device(schedule, shape, stash):
  """A vocabulary that S does not divide is padded in the state and nowhere else.

  The pipeline trains as one device on the 63-entry model; `Schedule.params`
  returns the natural shapes; the state holds 64 entries, and the padding
  stays exactly zero (its row is never looked up and its logit is masked
  out, so its gradient is zero).
  """
  s, d, m = shape
  got = run(schedule, s, d, m, "adamw", stash=stash, cfg=ODD_VOCAB)
  want = run("none", 1, 1, m, "adamw", cfg=ODD_VOCAB)
  v, dim = ODD_VOCAB.vocab_size, ODD_VOCAB.dim
  natural = {"embed/embedding": (v, dim), "head/out/kernel": (dim, v)}
  for path, shape_ in natural.items():
    assert _leaf(got.params, path).shape == shape_, path
    assert _leaf(want.params, path).shape == shape_, path
  assert_runs_match(got, want)
  embedding = _leaf(got.state_params, "embed/embedding")
  kernel = _leaf(got.state_params, "head/out/kernel")
  assert embedding.shape == (64, dim) and kernel.shape == (dim, 64)
  assert not embedding[v:].any() and not kernel[:, v:].any()


# --- where the embedding and the head live ------------------------------------

# (schedule, (S, D, M), stash, model): pipeline.head=last_stage, the embedding
# and head whole on every stage, used on the first and last. Untied and tied,
# a vocabulary S does not divide (nothing is padded then), S = 2 and 4, D = 1
# and 2, both stashes, 2bw and the flushed schedules (gpipe's head cotangent
# waits in the stash).
HEAD_CASES = [("2bw", (2, 1, 2), "residuals", util.CONFIG),
              ("2bw", (4, 2, 6), "inputs", TIED),
              ("1f1b", (4, 1, 4), "residuals", TIED),
              ("gpipe", (2, 2, 3), "inputs", ODD_VOCAB)]


@pytest.mark.parametrize("schedule,shape,stash,cfg", HEAD_CASES,
                         ids=[f"{c}-{util.shape_id(x)}-{st}-{'tied' if m.tie_embeddings else 'v' + str(m.vocab_size)}"
                              for c, x, st, m in HEAD_CASES])
def test_head_on_the_last_stage_matches_one_device(schedule, shape, stash, cfg):
  """pipeline.head=last_stage trains as one device, and as the vocabulary-parallel head.

  The shared parameters are whole (unpadded) in the state; their gradients
  (the lookup's on stage 0, the head's on the last stage, both for a tied
  matrix) are summed over the stages once per step.
  """
  s, d, m = shape
  got = run(schedule, s, d, m, "adamw", stash=stash, cfg=cfg, vocab_parallel=False)
  want = run("none", 1, 1, m, "adamw", delay=int(schedule == "2bw"), cfg=cfg)
  assert_runs_match(got, want)
  whole = _leaf(got.state_params, "embed/embedding")
  assert whole.shape == (cfg.vocab_size, cfg.dim)  # not padded to a multiple of S
  split = run(schedule, s, d, m, "adamw", stash=stash, cfg=cfg)
  assert_runs_match(got, split)


def test_head_placement_auto_follows_the_heads_share_of_a_stage():
  """`auto` puts the head on the last stage while it adds at most 5% to that stage's work."""
  from jaxpipe import config  # pylint: disable=g-import-not-at-top
  pipe = config.PipelineConfig(schedule="2bw", stages=2, microbatches=8)
  small = config.ModelConfig(vocab_size=257, dim=256, n_layers=8, n_heads=4, n_kv_heads=2)
  # A block: 256*64*(2*4 + 2*2) attention + 3*256*704 MLP = 737,280 matmul
  # parameters; a stage of 4 blocks 2,949,120; the head 256 x 257 = 65,792 (2.2%).
  assert not config.vocab_parallel(small, pipe)
  big = dataclasses.replace(small, vocab_size=50257)   # 12.9M: 436% of a stage
  assert config.vocab_parallel(big, pipe)
  # The threshold itself: 5% of the stage is 147,456 parameters = dim x 576.
  assert not config.vocab_parallel(dataclasses.replace(small, vocab_size=576), pipe)
  assert config.vocab_parallel(dataclasses.replace(small, vocab_size=577), pipe)
  for head, want in (("vocab_parallel", True), ("last_stage", False)):
    assert config.vocab_parallel(big if not want else small,
                                 dataclasses.replace(pipe, head=head)) is want
  # The pipeline's rule alone, on those numbers.
  from jaxpipe import pipeline  # pylint: disable=g-import-not-at-top
  for vocab, want in ((576, False), (577, True)):
    assert pipeline.vocab_parallel("auto", head_params=256 * vocab, block_params=737_280,
                                   num_layers=8, num_stages=2) is want


# --- bfloat16 ----------------------------------------------------------------

BF16 = util.config(compute_dtype="bfloat16")
# bfloat16 keeps 8 significant bits: unit roundoff u = 2^-8.
BF16_U = 2.0 ** -8
BF16_UPDATE_RTOL = 16 * BF16_U   # = 1/16, see test_bfloat16_matches_one_device
BF16_LOSS_RTOL = BF16_U / 8      # = 2^-11, likewise


def _bf16_errors(got: util.Run, want: util.Run) -> tuple[float, float, float]:
  """(step-0 loss error, worst loss error, worst leaf update error), each as a
  multiple of its tolerance: the step-0 loss against LOSS_TOL, every loss
  against BF16_LOSS_RTOL, and per weight leaf |got - want| / |want - w0| (the
  2-norm of the difference of the two displacements from the initial weights
  w0, relative to the reference's) against BF16_UPDATE_RTOL.
  """
  first = abs(got.losses[0] - want.losses[0]) / (
      util.LOSS_TOL["atol"] + util.LOSS_TOL["rtol"] * abs(want.losses[0]))
  later = np.max(np.abs(got.losses - want.losses) / (BF16_LOSS_RTOL * np.abs(want.losses)))
  w0 = util.initial_params(BF16)
  worst = 0.0
  for g, w, i in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params),
                     jax.tree.leaves(w0)):
    moved = np.linalg.norm(np.asarray(w, np.float64) - np.asarray(i, np.float64))
    assert moved > 0, "a weight leaf the reference never moved"
    worst = max(worst, np.linalg.norm(np.asarray(g, np.float64) - np.asarray(w, np.float64))
                / moved / BF16_UPDATE_RTOL)
  return float(first), float(later), float(worst)


# (schedule, (S, D, M), stash, delay of the reference's optimizer).
BF16_CASES = [("1f1b", (2, 1, 2), "residuals", 0), ("2bw", (2, 1, 2), "inputs", 1)]


@pytest.mark.parametrize("schedule,shape,stash,delay", BF16_CASES,
                         ids=[f"{c}-{util.shape_id(x)}-{st}" for c, x, st, _ in BF16_CASES])
def test_bfloat16_matches_one_device(schedule, shape, stash, delay):
  """In bfloat16 compute the pipeline trains as one device in bfloat16, to bf16 rounding.

  Plain SGD (lr 0.5), whose update is linear in the gradient, so the
  rounding of the gradient carries straight into the weights; AdamW would
  turn a rounding-level sign flip of a near-zero gradient entry into a full
  step of lr, whatever the tolerance.

  Why these tolerances. bf16 keeps 8 significant bits, u = 2^-8 = 3.9e-3.
  - The forward is the reference's bf16 program (the embedding psum adds
    zeros; each logit is the same bf16 dot with float32 accumulation), so
    the step-0 loss must agree to float32 rounding: LOSS_TOL, as everywhere
    (measured: bit-equal).
  - The backward rounds one thing differently: the cotangent of the last
    block's output. The reference rounds the full-vocabulary product
    dlogits W^T to bf16 once; the pipeline rounds each of the S stages'
    slice products before summing them: S roundings where the reference has
    one, <= S*u relative to first order. Every gradient leaf is linear in that
    cotangent (the rest of the backward is the same bf16 program), so each
    step's gradient differs by up to ~S*u = 2u (measured after one step:
    1.1u to 1.6u on every leaf). Over STEPS = 5 steps those errors add up to
    STEPS*S*u = 10u if they all point the same way, plus what the weights'
    discrepancy feeds back into later gradients: each leaf's displacement
    from the initial weights may differ by 16u = 1/16 of its norm (measured:
    at most 5.7u).
  - Later losses follow from weights that differ that way. They are float32
    means over 32 tokens, so they resolve far finer than bf16 (whose
    rounding at 4.2 is 0.016); a relative 2^-11 = u/8 (2.0e-3 at 4.2) covers
    the measured 5.6e-4 at step 4 with a margin of 3.6.
  test_bfloat16_check_is_discriminating shows that these tolerances still
  reject a wrong implementation (by factors of 10 and 18), and that
  float32's would reject this one. They cannot tell bf16 compute from
  float32 compute, though: two bf16 programs that round in different places
  are about as far apart as either is from float32 (float32 training is
  within 0.45 of each tolerance here).
  """
  s, d, m = shape
  got = run(schedule, s, d, m, "sgd", stash=stash, cfg=BF16)
  want = run("none", 1, 1, m, "sgd", delay=delay, cfg=BF16)
  first, later, update = _bf16_errors(got, want)
  assert first <= 1, f"step-0 loss off by {first:.2f} x LOSS_TOL"
  assert later <= 1, f"a loss off by {later:.2f} x {BF16_LOSS_RTOL:g} relative"
  assert update <= 1, f"a leaf's update off by {update:.2f} x {BF16_UPDATE_RTOL:g} relative"


def test_bfloat16_check_is_discriminating():
  """The bf16 tolerances reject a wrong implementation; float32's reject a right one.

  - 2bw, whose gradient is one step old, against the undelayed bf16
    reference: its weights' displacement misses by far more than 1/16, so
    an error as large as running on a stale weight version cannot hide in
    the bf16 tolerance.
  - The correct bf16 1f1b run fails the float32 check (assert_runs_match):
    the looser tolerance is needed, and bf16 really is what ran.
  """
  wrong = run("2bw", 2, 1, 2, "sgd", cfg=BF16)
  want = run("none", 1, 1, 2, "sgd", cfg=BF16)
  first, later, update = _bf16_errors(wrong, want)
  assert first <= 1   # batch 0 runs on the initial weights either way
  assert update > 4 and later > 1, (later, update)

  right = run("1f1b", 2, 1, 2, "sgd", cfg=BF16)
  with pytest.raises(AssertionError):
    assert_runs_match(right, want)
