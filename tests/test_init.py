"""Sharded initialisation: parameters are drawn in their shardings, never whole on one device."""

import re

import jax
import numpy as np
import optax
import pytest

from jaxpipe import model as model_lib
from jaxpipe.config import ModelConfig
from jaxpipe.pipeline import make_mesh, make_schedule
from jaxpipe.trainer import stage_fns

# Distinct sizes, so a full-size parameter is recognisable in the compiled program.
CFG = ModelConfig(vocab_size=257, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96)
BATCH = (2, 4, 8)


def _schedule(name, stages, data):
  model = model_lib.make_model(CFG)
  mesh = make_mesh(stages, data, jax.devices()[:stages * data])
  return model, make_schedule(name, stage_fns(model), optax.adamw(1e-3), mesh, 2)


def _shapes_in(hlo: str) -> set[str]:
  return set(re.findall(r"f32\[[0-9,]*\]", hlo))


@pytest.mark.parametrize("name", ["2bw", "1f1b"])
def test_init_draws_each_shard_where_it_lives(name):
  model, sch = _schedule(name, 2, 2)
  rng = jax.random.key(0)
  state = sch.init_sharded(model.init, rng, BATCH)
  # Every array is in the state's sharding, and a stage holds half the blocks.
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(sch.state_shardings(state))):
    assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
  gate = sch.newest(state)["blocks"]["mlp"]["gate"]["kernel"]
  assert gate.shape == (4, 32, 96)
  assert {sh.data.shape for sh in gate.addressable_shards} == {(2, 32, 96)}
  # The same numbers as drawing the whole model on one device.
  whole = sch.init(jax.jit(model.init)(rng), BATCH)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(whole))


def test_the_compiled_init_never_holds_a_whole_parameter():
  model, sch = _schedule("2bw", 2, 2)
  rng = jax.random.key(0)
  sharded = sch.init_program(model.init, rng, BATCH)
  whole = {"f32[4,32,96]", "f32[257,32]", "f32[32,257]", "f32[258,32]", "f32[32,258]"}
  assert not whole & _shapes_in(sharded.lower(rng).compile().as_text())
  # The check can fail: drawing the model unsharded does hold them.
  assert whole & _shapes_in(jax.jit(model.init).lower(rng).compile().as_text())
