"""The ('stage', 'data') device mesh, laid out over the nodes the devices sit on.

On one node (one process, or several processes of one host) the mesh is the
devices in order, S rows of D. When the devices span several nodes, which
axis crosses the slow links between nodes is the layout's choice:

  stage  the stage axis is split over as many node groups as it can take
         (gcd(S, nodes)); the data axis over the rest. With D devices per
         node, each node holds whole stages: data-parallel all-reduces stay
         inside a node and only activations and cotangents cross nodes.
  data   the data axis is split over nodes first (gcd(D, nodes)); the stage
         axis over the rest: each node holds whole pipelines and the
         gradient all-reduce crosses nodes.

A node is what XLA gives one `slice_index`: on GPUs the devices of one host,
told apart by the host's boot id (or of one NVLink domain, where the
launcher sets JAX's partition index). On CPU devices, where every process
of a host shares one slice index, each process is a node: a run of several
processes on one machine then lays out its mesh as a cluster would. So is
it for the devices of a GPU topology compiled for without GPUs
(`jaxpipe.gpu`), whose slice index is 0 on every node. The
arrangement within and across nodes is
`jax.experimental.mesh_utils.create_hybrid_device_mesh`'s.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxpipe.pipeline._names import DATA, LAYOUTS, STAGE

__all__ = ["make_mesh", "device_grid", "node_split", "node_of", "axes_across_nodes"]


def _by_process(device: Any) -> bool:
  """Whether a device's node is its process: CPU devices, any without a slice index, and
  the devices of a topology compiled for ahead of time (whose process index is their node)."""
  return (device.platform == "cpu" or getattr(device, "slice_index", None) is None
          or type(getattr(device, "client", None)).__name__ == "CompileOnlyPyClient")


def node_of(device: Any) -> int:
  """The node a device sits on: its slice index, or its process on CPU devices (see module doc)."""
  return device.process_index if _by_process(device) else device.slice_index


def node_split(num_stages: int, num_data: int, num_nodes: int, layout: str) -> tuple[int, int]:
  """(node groups along stage, along data): how `layout` spreads an S x D mesh over the nodes.

  Raises ValueError when the nodes cannot split the axes evenly that way.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
  if layout == "stage":
    along_stage = math.gcd(num_stages, num_nodes)
    along_data = num_nodes // along_stage
  else:
    along_data = math.gcd(num_data, num_nodes)
    along_stage = num_nodes // along_data
  if num_stages % along_stage or num_data % along_data:
    raise ValueError(
        f"{num_nodes} nodes do not split stage x data = {num_stages} x {num_data} with the "
        f"{layout} axis across nodes ({along_stage} x {along_data} node groups); choose "
        "stages and data replicas whose product splits over the nodes, or the other layout")
  return along_stage, along_data


def device_grid(num_stages: int, num_data: int, devices: Sequence[Any],
                layout: str = "stage") -> np.ndarray:
  """The [S, D] array of the first S*D devices, laid out over their nodes (see module doc)."""
  need = num_stages * num_data
  devices = list(devices)
  if need > len(devices):
    raise ValueError(f"the mesh needs stages x data = {num_stages} x {num_data} = {need} "
                     f"devices, but only {len(devices)} are available")
  devices = devices[:need]
  nodes = sorted({node_of(d) for d in devices})
  if len(nodes) == 1:
    # One node: the devices in order, as JAX lists them.
    return np.array(devices, dtype=object).reshape(num_stages, num_data)
  counts = {n: sum(node_of(d) == n for d in devices) for n in nodes}
  if len(set(counts.values())) != 1:
    raise ValueError(f"the mesh's {need} devices sit unevenly on {len(nodes)} nodes "
                     f"({sorted(counts.values())} devices each); give the mesh all devices "
                     "of whole nodes")
  along_stage, along_data = node_split(num_stages, num_data, len(nodes), layout)
  return mesh_utils.create_hybrid_device_mesh(
      (num_stages // along_stage, num_data // along_data), (along_stage, along_data), devices,
      process_is_granule=_by_process(devices[0]))


def make_mesh(num_stages: int, num_data: int, devices=None, *, layout: str = "stage") -> Mesh:
  """A ('stage', 'data') mesh of the first S*D devices, with Auto axes, laid out by `layout`."""
  devices = jax.devices() if devices is None else devices
  grid = device_grid(num_stages, num_data, devices, layout)
  return Mesh(grid, (STAGE, DATA), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def axes_across_nodes(grid: np.ndarray) -> list[str]:
  """The mesh axes ('stage', 'data') along which neighbouring devices sit on different nodes."""
  nodes = np.vectorize(node_of, otypes=[int])(grid)
  out = []
  for axis, name in enumerate((STAGE, DATA)):
    if np.any(np.diff(nodes, axis=axis) != 0):
      out.append(name)
  return out
