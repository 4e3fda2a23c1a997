"""Gradient reduction over a data axis that spans hosts: within each host first.

When the mesh lays the `data` axis out as `slow` hosts x `fast` devices on
each (plait.mesh.axis_split, from `data=S@dcn,data=F`), a flat all-reduce
sends about twice the gradients over the slow links. PHub's rack-aware
aggregation (and NCCL's hierarchical all-reduce) sends 1/fast of that:

1. reduce-scatter over each host's devices (fast links): each device holds
   its host's sum of 1/fast of the gradients;
2. all-reduce those shards over the hosts (slow links);
3. all-gather over each host's devices.

The per-replica gradients come stacked [replica, ...] over `data` (the model
traced per replica with `vmap(spmd_axis_name="data")`); the three
collectives run on one flat bucket of every leaf (one of each per step, not
one per leaf), written with shard_map and `axis_index_groups` over `data`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from plait import hosts
from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.errors import UserError

AXIS = "data"


def index_groups(slow: int, fast: int) -> tuple[list[list[int]], list[list[int]]]:
    """(each host's data indices, each host-rank's indices across hosts): data index
    k = host * fast + rank, as `plait.mesh.build_mesh` lays the axis out."""
    hosts = [[s * fast + f for f in range(fast)] for s in range(slow)]
    across = [[s * fast + f for s in range(slow)] for f in range(fast)]
    return hosts, across


def reduce_scatter_rows(x: jax.Array, split: tuple[int, int]) -> jax.Array:
    """Inside a shard_map over `data`: x [R, cols] on every replica -> [cols], row k of
    the sum over replicas on data index k. Hierarchical where the split applies (within
    each host, then across hosts on 1/fast of it), else one reduce-scatter."""
    slow, fast = split
    if not applies(split):
        return jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)[0]
    within, across = index_groups(slow, fast)
    R, cols = x.shape
    # Rows in (rank, host) order: rank f's chunk holds the rows of data indices h*fast+f.
    x = x.reshape(slow, fast, cols).transpose(1, 0, 2).reshape(R, cols)
    x = jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True,
                             axis_index_groups=within)  # [slow, cols]
    return jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True,
                                axis_index_groups=across)[0]


def all_gather_rows(x: jax.Array, split: tuple[int, int]) -> jax.Array:
    """Inside a shard_map over `data`: x [cols] on data index k -> [R, cols] (row k from
    index k) on every replica; across hosts first, then within each host."""
    slow, fast = split
    if not applies(split):
        return jax.lax.all_gather(x, AXIS, tiled=False)
    within, across = index_groups(slow, fast)
    x = jax.lax.all_gather(x, AXIS, tiled=False, axis_index_groups=across)  # [slow, cols]
    x = jax.lax.all_gather(x, AXIS, tiled=False, axis_index_groups=within)  # [fast, slow, .]
    return x.transpose(1, 0, 2).reshape(slow * fast, -1)


def mean_over_data(stacked: dict, specs: dict, mesh: Mesh, split: tuple[int, int]) -> dict:
    """The mean over the replica dimension of `stacked` ([R, ...] over `data`; `specs`
    the single model's PartitionSpecs): laid out as `specs`, the same on every replica.
    `split` = (slow, fast) of the data axis; slow = 1 or fast = 1 is one flat ring."""
    slow, fast = split
    R = slow * fast
    within, across = index_groups(slow, fast)
    flat_specs, tdef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(stacked)

    def body(*xs):
        dtype = jnp.result_type(*xs)
        parts = [x[0].astype(dtype).reshape(-1) for x in xs]
        sizes = [p.size for p in parts]
        bucket = jnp.concatenate(parts)
        pad = -bucket.size % fast
        bucket = jnp.pad(bucket, (0, pad))
        if applies(split):
            shard = jax.lax.psum_scatter(bucket, AXIS, scatter_dimension=0, tiled=True,
                                         axis_index_groups=within)
            shard = jax.lax.psum(shard, AXIS, axis_index_groups=across)
            bucket = jax.lax.all_gather(shard, AXIS, axis=0, tiled=True,
                                        axis_index_groups=within)
        else:
            bucket = jax.lax.psum(bucket, AXIS)
        bucket = bucket[:bucket.size - pad] / R
        out = jnp.split(bucket, np.cumsum(sizes)[:-1])
        return tuple(o.reshape(x.shape[1:]).astype(x.dtype)
                     for o, x in zip(out, xs, strict=True))

    in_specs = tuple(P(AXIS, *s) for s in flat_specs)
    # A bucket mixes leaves split over fsdp / tensor with replicated ones: it varies
    # over those axes, though each replicated leaf's slice of it does not.
    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tuple(flat_specs),
                        check_vma=False)(*leaves)
    return jax.tree.unflatten(tdef, list(out))


def applies(split: tuple[int, int]) -> bool:
    """Whether the data axis has both a slow and a fast part (else a flat ring is as good)."""
    return split[0] > 1 and split[1] > 1


def for_run(exp: Experiment, mesh: Mesh, pipelined: bool) -> tuple[int, int] | None:
    """(slow, fast) of the data axis when "allreduce" reduces the gradients
    hierarchically (sync.reduce), else None (one all-reduce, as GSPMD puts it).
    EASGD and DiLoCo make their exchange hierarchical themselves (parallel.local_sgd)."""
    cfg = exp.sync
    if cfg.reduce == "flat":
        return None
    split = hosts.axis_split(mesh, AXIS)
    mode = mesh_lib.tensor_mode(dict(mesh.shape))
    if not applies(split):
        why = ("the mesh's data axis does not have parts both across and within hosts; "
               "declare them (data=2@dcn,data=4) or use sync.reduce = \"flat\"")
    elif cfg.method != "allreduce":
        return None
    elif exp.model.moe is not None:
        why = ("a mixture of experts trains with one flat gradient all-reduce (it is not "
               "traced per data replica); use sync.reduce = \"flat\"")
    elif exp.model.fp8_history:
        why = ("FP8 matmuls combine their scaling state by maximum over replicas, which a "
               "per-replica reduction would sum; use sync.reduce = \"flat\"")
    elif pipelined:
        why = "it does not run with a pipeline yet; use pipeline = 1 or sync.reduce = \"flat\""
    elif mode not in (None, "1d"):
        why = (f"it runs with fsdp and 1-D tensor, not the {mesh_lib.MODE_NAMES[mode]} tensor "
               "mode; use sync.reduce = \"flat\"")
    else:
        return split
    if cfg.reduce == "hierarchical":
        raise UserError(f"sync.reduce = \"hierarchical\": {why}")
    return None
