"""One process of the two-process click-batch test: writes its shards of a batch."""

import sys

import jax
import numpy as np

port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

from helpers import make_mesh  # noqa: E402
from test_data import click_experiment  # noqa: E402

from plait.tasks.dlrm import DLRMTask  # noqa: E402

task = DLRMTask(click_experiment(), make_mesh("data=8"))
batch = task.batch(task.source(), 7)
shards = {}
for name, arr in batch.items():
    for s in arr.addressable_shards:
        shards[f"{name}:{s.index[0].start}"] = np.asarray(s.data)
np.savez(out, **shards)
