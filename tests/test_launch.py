"""Several processes and nodes on a CPU: this process's GPUs from the launcher, and the mesh laid
out over nodes (mesh.layout), with devices that stand in for GPUs on two hosts."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxpipe import config as config_lib, launch
from jaxpipe.errors import ConfigError
from jaxpipe.pipeline import _mesh, axes_across_nodes, make_mesh
from tests import _runs

CFG = config_lib.load(_runs.TINY)


def _ids(env, spec=""):
  cfg = dataclasses.replace(CFG, dist=dataclasses.replace(CFG.dist, local_device_ids=spec))
  return launch.local_device_ids(cfg, env)


EIGHT = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


@pytest.mark.parametrize("env,want", [
    ({}, None),                                                    # nothing says: JAX's default
    (EIGHT, list(range(8))),                                       # one process sees all eight
    # SLURM, one task per node: every GPU, listed (JAX's own detection would give GPU 0 only).
    ({"SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x4)", **EIGHT}, list(range(8))),
    # SLURM, a task per GPU, GPUs not bound per task: task 3 takes GPU 3.
    ({"SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1", **EIGHT},
     [3]),
    # SLURM bound each task to its own GPU (--gpus-per-task=1): the one it sees.
    ({"SLURM_LOCALID": "5", "SLURM_TASKS_PER_NODE": "8", "CUDA_VISIBLE_DEVICES": "5"}, [0]),
    # Two tasks per node on eight GPUs: four each.
    ({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"},
     [4, 5, 6, 7]),
    # Uneven nodes: this node's entry of the list.
    ({"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "1", **EIGHT},
     [4, 5, 6, 7]),
    # torchrun-style launchers.
    ({"LOCAL_RANK": "6", "LOCAL_WORLD_SIZE": "8"}, [6]),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **EIGHT}, [4, 5, 6, 7]),
    # JAX's own variable: left to JAX.
    ({"JAX_LOCAL_DEVICE_IDS": "2", "LOCAL_RANK": "6", "LOCAL_WORLD_SIZE": "8"}, None),
], ids=["none", "one-process", "slurm-per-node", "slurm-per-gpu", "slurm-bound",
        "slurm-two-per-node", "slurm-uneven", "torchrun", "torchrun-four-each", "jax-env"])
def test_local_device_ids_from_the_launcher(env, want):
  assert _ids(env) == want


def test_explicit_local_device_ids_win_and_are_checked():
  assert _ids({"LOCAL_RANK": "6", "LOCAL_WORLD_SIZE": "8"}, "0,1") == [0, 1]
  assert config_lib.load(_runs.TINY, ["dist.local_device_ids=2,3"]).dist.local_device_ids == "2,3"
  for bad in ("a", "1,1", "-1", "0,,1"):
    with pytest.raises(ConfigError, match="dist.local_device_ids must be distinct device numbers"):
      config_lib.load(_runs.TINY, [f"dist.local_device_ids={bad}"])
  with pytest.raises(ConfigError, match="6 GPUs do not split evenly over the 4 processes"):
    _ids({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"})


# --- the mesh over nodes --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gpu:
  """A GPU as the mesh builder reads one: XLA gives the GPUs of a host one slice index."""
  id: int
  process_index: int
  slice_index: int
  device_kind: str = "NVIDIA H100 80GB HBM3"
  platform: str = "gpu"


def _hosts(hosts, per_host, process_per_gpu=False):
  return [Gpu(h * per_host + g, h * per_host + g if process_per_gpu else h, h)
          for h in range(hosts) for g in range(per_host)]


def _nodes(grid):
  return np.vectorize(_mesh.node_of, otypes=[int])(grid)


@pytest.mark.parametrize("process_per_gpu", [False, True], ids=["process-per-host",
                                                                 "process-per-gpu"])
def test_layouts_over_two_hosts(process_per_gpu):
  devices = _hosts(2, 8, process_per_gpu)
  # stage: each host holds one stage with its 8 replicas; only activations cross hosts.
  grid = _mesh.device_grid(2, 8, devices, "stage")
  assert _nodes(grid).tolist() == [[0] * 8, [1] * 8]
  assert axes_across_nodes(grid) == ["stage"]
  # data: each host holds 4 replicas of both stages; the pipeline stays inside a host.
  grid = _mesh.device_grid(2, 8, devices, "data")
  assert _nodes(grid).tolist() == [[0] * 4 + [1] * 4] * 2
  assert axes_across_nodes(grid) == ["data"]
  assert sorted(d.id for d in grid.flat) == list(range(16))


def test_cpu_processes_are_nodes():
  # Processes of one machine share its slice index; on CPU devices each process is a node.
  devices = [Gpu(p * 2 + i, p, 0, "cpu", "cpu") for p in range(2) for i in range(2)]
  assert axes_across_nodes(_mesh.device_grid(2, 2, devices, "stage")) == ["stage"]
  assert axes_across_nodes(_mesh.device_grid(2, 2, devices, "data")) == ["data"]


def test_layouts_split_what_the_nodes_cannot_take_whole():
  # 4 hosts, 2 stages: the stage axis takes 2 host groups, data the other factor of 2.
  grid = _mesh.device_grid(2, 16, _hosts(4, 8), "stage")
  assert _nodes(grid).tolist() == [[0] * 8 + [1] * 8, [2] * 8 + [3] * 8]
  assert axes_across_nodes(grid) == ["stage", "data"]
  # 4 hosts, 4 stages of 8 (schedule none has 1 stage: data spans the hosts either way).
  assert axes_across_nodes(_mesh.device_grid(1, 32, _hosts(4, 8), "stage")) == ["data"]
  assert _mesh.node_split(4, 8, 4, "data") == (1, 4)
  with pytest.raises(ValueError, match="3 nodes do not split stage x data = 2 x 4"):
    _mesh.node_split(2, 4, 3, "stage")
  with pytest.raises(ValueError, match="sit unevenly on 2 nodes"):
    # The first 4 of 6 devices: 3 on one host, 1 on the other.
    _mesh.device_grid(2, 2, _hosts(2, 3), "stage")


def test_one_node_keeps_jax_device_order():
  devices = jax.devices()[:8]
  for layout in ("stage", "data"):
    mesh = make_mesh(2, 4, devices, layout=layout)
    assert mesh.devices.tolist() == np.array(devices).reshape(2, 4).tolist()
    assert axes_across_nodes(mesh.devices) == []


def test_mesh_layout_is_validated():
  assert config_lib.load(_runs.TINY).mesh.layout == "stage"
  assert config_lib.load(_runs.TINY, ["mesh.layout=data"]).mesh.layout == "data"
  with pytest.raises(ConfigError, match="mesh.layout must be stage or data, got 'nodes'"):
    config_lib.load(_runs.TINY, ["mesh.layout=nodes"])
