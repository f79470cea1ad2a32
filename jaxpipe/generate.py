"""Sampling from a trained model: a jitted decoder with a key-value cache, on one device.

  from jaxpipe import generate as gen
  out = gen.generate(cfg.model, params, [[1, 2, 3], [4, 5]], max_new_tokens=32,
                     temperature=0.8, top_p=0.95, seed=0, eos_id=tok.eos_id)

How a batch of prompts is decoded (`decode`):
  1. Prefill. The prompts are right-padded to a bucket of P tokens (a power of
     two, at least MIN_BUCKET), so prompts of many lengths share a few
     compiled programs. One forward of the [batch, P] tokens at positions
     0..P-1 writes every block's keys and values into a cache of `slots`
     positions and gives the logits of each prompt's last real token. Causal
     attention keeps the padding, which comes after every real token, out of
     the real tokens' results.
  2. Decoding, a `lax.while_loop` over new tokens: sample each row's next
     token from its logits, then run that one token per row through the
     blocks at its own position (a prompt of n tokens puts its s-th new token
     at position n + s), writing its keys and values into that slot and
     attending to the slots at or before it. A padding slot of a short
     prompt is overwritten by that row's token before any query can see it.
     The loop ends when every row has its tokens or has emitted eos_id.

The blocks are the model's own (`jaxpipe.model.Block` called with positions and a
`KVCache`): the same projections, rotary embedding, norms and MLP as the
training forward, so the cached logits equal the training `logits` of the
whole sequence to float32 rounding. Only the attention differs in how it is
computed: XLA's masked dense attention over the cache, whatever
`model.attention` chose for training.

Mixture-of-Experts blocks are decoded without capacity: every token goes to
its top_k experts (`dropless`). Training drops tokens beyond an expert's
capacity, ceil(capacity_factor * seq * top_k / experts) slots per sequence,
and that capacity grows with the sequence, so which earlier tokens the
training forward drops changes as the sequence grows by one token: no cache
can reproduce that, and dropping a lone decoded token would make no sense.
The decoder therefore computes the training forward of the same model with
a capacity that never drops (capacity_factor = experts / top_k), which is
the training forward itself wherever training dropped nothing.

The context length: `context_len` (a run's data.seq_len, the length the
model was trained on) bounds prompt plus continuation. A prompt longer than
it is refused; a continuation stops when its sequence reaches it, so a row
may return fewer than max_new_tokens tokens. None means no bound (rotary
positions extrapolate, though the model never saw them).

Sampling (`sample`): temperature 0 is greedy (argmax); otherwise the logits
are divided by the temperature, cut to the top_k most likely tokens and then
to the top_p nucleus (`filter_logits`), and drawn with a JAX PRNG key. Row i
uses the key fold_in(fold_in(key(seed), i), step), so a seed gives the same
samples on every run, and a prompt's sample does not depend on the other
prompts of its batch (up to float rounding of their shared programs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe.config import ModelConfig
from jaxpipe.errors import InputError
from jaxpipe import model as model_lib

__all__ = ["MIN_BUCKET", "Sampling", "Decoded", "generate", "decode", "sample", "filter_logits",
           "dropless", "bucket"]

# The smallest prompt and step bucket: short prompts all share one program.
MIN_BUCKET = 16


def bucket(n: int, smallest: int = MIN_BUCKET) -> int:
  """The power of two at or above max(n, smallest): padded sizes that compile once each."""
  return max(smallest, 1 << max(0, int(n) - 1).bit_length())


def dropless(cfg: ModelConfig) -> ModelConfig:
  """The model config that decoding computes: a MoE capacity that never drops a token.

  With capacity_factor = num_experts / top_k an expert has a slot for every
  token of the sequence (a token picks an expert at most once), so no token
  is dropped; the parameters are unchanged. Dense configs are returned as
  they are.
  """
  if not cfg.moe.num_experts:
    return cfg
  factor = cfg.moe.num_experts / cfg.moe.top_k
  return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=factor))


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each next token is drawn from the model's logits.

  Attributes:
    temperature: 0 = greedy (argmax, no randomness); otherwise the logits
      are divided by it before sampling (below 1 sharpens, above flattens).
    top_k: keep only the k most likely tokens (None = all).
    top_p: keep only the nucleus: the most likely tokens, in order, until
      their probability reaches top_p, in (0, 1] (None or 1 = all).
  """
  temperature: float = 1.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None

  def __post_init__(self):
    t, k, p = self.temperature, self.top_k, self.top_p
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise InputError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
      raise InputError(f"top_k must be an integer >= 1 (or None for all tokens), got {k!r}")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                          or not 0 < p <= 1):
      raise InputError(f"top_p must be in (0, 1] (or None for all tokens), got {p!r}")


def filter_logits(logits: jax.Array, top_k=None, top_p=None) -> jax.Array:
  """The logits with -inf outside the top_k largest and outside the top_p nucleus.

  The nucleus is taken after the top-k cut, over the distribution softmax of
  what top-k kept: the most likely tokens in order while the probability of
  those before them is below top_p (so the most likely token is always
  kept, and the kept mass is the first to reach top_p). Tokens tied with the
  last one kept are kept too. top_k and top_p may be traced values; None
  (or top_k >= vocab, top_p >= 1) turns either off.

  Args:
    logits: [..., vocab].
    top_k: int >= 1, or None.
    top_p: float in (0, 1], or None.
  """
  vocab = logits.shape[-1]
  k = vocab if top_k is None else jnp.clip(top_k, 1, vocab)
  p = 1.0 if top_p is None else top_p
  desc = -jnp.sort(-logits, axis=-1)
  kth = jnp.take(desc, k - 1, axis=-1)[..., None]
  desc = jnp.where(desc < kth, -jnp.inf, desc)
  probs = jax.nn.softmax(desc, axis=-1)
  # The mass before each token, summed from the most likely: exactly 0 for
  # the first, which is therefore always in the nucleus.
  before = jnp.concatenate([jnp.zeros_like(probs[..., :1]),
                            jnp.cumsum(probs, axis=-1)[..., :-1]], axis=-1)
  last = jnp.min(jnp.where(before < p, desc, jnp.inf), axis=-1, keepdims=True)
  # Rounding can leave the cumulative sum a hair below 1: top_p = 1 cuts nothing.
  cutoff = jnp.maximum(kth, jnp.where(p < 1, last, -jnp.inf))
  return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample(key: jax.Array, logits: jax.Array, temperature=1.0, top_k=None,
           top_p=None) -> jax.Array:
  """Token ids drawn from `logits` [..., vocab]: int32 [...].

  temperature 0 gives the argmax; otherwise softmax(filter_logits(logits /
  temperature, top_k, top_p)) is sampled with `key` (each leading row
  independently). Every argument may be traced, so one compiled program
  serves every setting.
  """
  t = jnp.asarray(temperature, jnp.float32)
  greedy = jnp.argmax(logits, axis=-1)
  scaled = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
  drawn = jax.random.categorical(key, filter_logits(scaled, top_k, top_p), axis=-1)
  return jnp.where(t > 0, drawn, greedy).astype(jnp.int32)


class Decoded(NamedTuple):
  """What `decode` returns.

  Attributes:
    tokens: per prompt, its new token ids (ending with eos_id when the
      model emitted it; fewer than max_new_tokens at eos or the context
      length).
    logits: per prompt, float32 [len(tokens), vocab]: the logits each new
      token was drawn from (before temperature and filtering); None unless
      asked for.
  """
  tokens: list[list[int]]
  logits: Optional[list[np.ndarray]]


@functools.partial(jax.jit, static_argnames=("cfg", "slots", "steps", "return_logits"))
def _decode(params, tokens, lengths, budgets, key, temperature, top_k, top_p, eos_id, *,
            cfg, slots, steps, return_logits):
  """(new tokens [b, steps] (-1 past each row's end), logits [b, steps, V] or None).

  tokens [b, P] right-padded prompts of `lengths` [b]; budgets [b] is the
  most tokens each row may add (<= steps); eos_id -1 means none.
  """
  model, block = model_lib.make_model(cfg), model_lib.Block(cfg)
  b, p = tokens.shape
  shape = (cfg.n_layers, b, slots, cfg.n_kv_heads, cfg.dim // cfg.n_heads)
  empty = jnp.zeros(shape, model_lib.dtype_of(cfg.compute_dtype))

  def forward(cache, ids, positions):
    def layer(x, blk):
      x, _, c = block.apply({"params": blk[0]}, x, positions, blk[1])
      return x, c
    return lax.scan(layer, model.embed(params, ids), (params["blocks"], cache))

  x, cache = forward(model_lib.KVCache(empty, empty), tokens,
                     jnp.broadcast_to(jnp.arange(p), (b, p)))
  last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [b, 1, dim]
  logits = model.logits(params, last)[:, 0]
  rows = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
  out = jnp.full((b, steps), -1, jnp.int32)
  seen = jnp.zeros((b, steps, logits.shape[-1]) if return_logits else (), jnp.float32)
  done = budgets <= 0

  def step(state):
    s, cache, logits, out, seen, done = state
    keys = jax.vmap(jax.random.fold_in, (0, None))(rows, s)
    tok = jax.vmap(sample, (0, 0, None, None, None))(keys, logits, temperature, top_k, top_p)
    out = out.at[:, s].set(jnp.where(done, -1, tok))
    if return_logits:
      seen = seen.at[:, s].set(logits)
    done = done | (s + 1 >= budgets) | (tok == eos_id)
    # A finished row still runs (the batch moves together); its slot is
    # clamped into the cache and its results are never read.
    positions = jnp.minimum(lengths + s, slots - 1)[:, None]
    x, cache = forward(cache, tok[:, None], positions)
    return s + 1, cache, model.logits(params, x)[:, 0], out, seen, done

  def more(state):
    return (state[0] < steps) & ~jnp.all(state[-1])

  _, _, _, out, seen, _ = lax.while_loop(more, step, (jnp.int32(0), cache, logits, out, seen, done))
  return out, (seen if return_logits else None)


def _check_prompts(prompts, vocab: int, context_len: Optional[int]) -> list[list[int]]:
  """The prompts as lists of ints; InputError for an empty or out-of-range one."""
  if isinstance(prompts, (np.ndarray, jax.Array)):
    prompts = np.asarray(prompts).tolist()
  if len(prompts) and all(isinstance(t, (int, np.integer)) for t in prompts):
    prompts = [prompts]  # one prompt
  if not len(prompts):
    raise InputError("no prompts given")
  out = []
  for i, prompt in enumerate(prompts):
    ids = [int(t) for t in prompt]
    if not ids:
      raise InputError(f"prompt {i} is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise InputError(f"prompt {i} holds token id {bad[0]}, outside the model's vocabulary "
                       f"[0, {vocab})")
    if context_len is not None and len(ids) > context_len:
      raise InputError(f"prompt {i} has {len(ids)} tokens, more than the model's context "
                       f"length of {context_len}; shorten it")
    out.append(ids)
  return out


def decode(cfg: ModelConfig, params: Any, prompts: Sequence[Sequence[int]] | Sequence[int], *,
           max_new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
           eos_id: Optional[int] = None, context_len: Optional[int] = None, device=None,
           return_logits: bool = False) -> Decoded:
  """Continues each prompt with up to max_new_tokens sampled tokens, on one device.

  See the module docstring for the cache, the padding, MoE and the context
  length. Compiled programs are cached per (model, batch size, prompt
  bucket, cache bucket, step bucket); the sampling values, seed and eos_id
  are data, so changing them compiles nothing.

  Args:
    cfg: the model config (vocab_size resolved), as trained.
    params: the model's parameters in their natural shapes (any placement:
      they are copied to `device`).
    prompts: a list of token-id lists, or one list of token ids.
    max_new_tokens: the most tokens to add to each prompt (>= 0).
    sampling: temperature, top_k, top_p.
    seed: the PRNG seed; the same seed gives the same tokens.
    eos_id: a row stops after emitting it (it is included); None = never.
    context_len: the most tokens a sequence may hold, prompt included; None
      = no bound.
    device: where to run; None = the first device.
    return_logits: also return the logits each new token was drawn from.

  Raises:
    InputError: an empty or too long prompt, an id outside the vocabulary,
      or a bad max_new_tokens, eos_id or context_len.
  """
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 0:
    raise InputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
  if context_len is not None and (not isinstance(context_len, (int, np.integer))
                                  or context_len < 1):
    raise InputError(f"context_len must be an integer >= 1 (or None), got {context_len!r}")
  if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
    raise InputError(f"eos_id {eos_id} is outside the model's vocabulary [0, {cfg.vocab_size})")
  prompts = _check_prompts(prompts, cfg.vocab_size, context_len)
  lengths = np.array([len(p) for p in prompts], np.int32)
  budgets = np.full_like(lengths, max_new_tokens)
  if context_len is not None:
    budgets = np.minimum(budgets, context_len - lengths)
  if budgets.max() == 0:
    empty = np.zeros((0, cfg.vocab_size), np.float32)
    return Decoded([[] for _ in prompts], [empty for _ in prompts] if return_logits else None)

  width = bucket(lengths.max())
  tokens = np.zeros((len(prompts), width), np.int32)
  for row, ids in zip(tokens, prompts):
    row[:len(ids)] = ids
  device = device or jax.devices()[0]
  put = functools.partial(jax.device_put, device=device)
  vocab = cfg.vocab_size
  out, seen = _decode(
      put(params), put(tokens), put(lengths), put(budgets), put(jax.random.key(seed)),
      put(np.float32(sampling.temperature)), put(np.int32(sampling.top_k or vocab)),
      put(np.float32(sampling.top_p or 1.0)), put(np.int32(-1 if eos_id is None else eos_id)),
      cfg=dropless(cfg), slots=bucket((lengths + budgets).max()), steps=bucket(budgets.max()),
      return_logits=return_logits)
  out = np.asarray(out)
  counts = (out >= 0).sum(axis=1)
  new = [row[:n].tolist() for row, n in zip(out, counts)]
  if return_logits:
    seen = np.asarray(seen)
    return Decoded(new, [s[:n] for s, n in zip(seen, counts)])
  return Decoded(new, None)


def generate(cfg: ModelConfig, params: Any, prompts: Sequence[Sequence[int]] | Sequence[int], *,
             max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: int = 0, eos_id: Optional[int] = None,
             context_len: Optional[int] = None, device=None) -> list[list[int]]:
  """The new token ids of each prompt: `decode(...).tokens` with the sampling given inline.

  temperature=0 is greedy decoding. One prompt (a list of ints) gives a list
  of one continuation. Raises InputError for bad input (see `decode` and
  `Sampling`).
  """
  return decode(cfg, params, prompts, max_new_tokens=max_new_tokens,
                sampling=Sampling(temperature, top_k, top_p), seed=seed, eos_id=eos_id,
                context_len=context_len, device=device).tokens
