"""One linear layer Y = X W (forward + backward) under 2-D and 3-D layouts, two ways.

    python benchmarks/gspmd_vs_shard_map.py

(a) GSPMD given only the layouts as sharding annotations, (b) plait's explicit
`parallel.tensor.gathered_matmul`. Prints the collectives of each compiled
program and their wire bytes per device against the papers' formulas. This is
the evidence behind writing the 2-D / 3-D layers with shard_map
(docs/architecture.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from report import run_script  # benchmarks/ is the script's directory

jax.config.update("jax_num_cpu_devices", 8)

from plait import analysis  # noqa: E402
from plait.parallel.tensor import gathered_matmul  # noqa: E402

T, K, N = 512, 256, 1024


def measure(mesh, xs: P, ws: P, ys: P, explicit: bool) -> float:
    x = jax.ShapeDtypeStruct((T, K), jnp.float32, sharding=NamedSharding(mesh, xs))
    w = jax.ShapeDtypeStruct((K, N), jnp.float32, sharding=NamedSharding(mesh, ws))

    def loss(x, w):
        if explicit:
            y = gathered_matmul("tk,kn->tn", x, w, mesh=mesh, x_spec=xs, w_spec=ws, out_spec=ys,
                                x_contracted=[1], w_contracted=[0])
        else:
            y = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, ys))
        return jnp.sum(jnp.tanh(y))

    shardings = (NamedSharding(mesh, xs), NamedSharding(mesh, ws))
    step = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=shardings)
    report = analysis.analyze(step.lower(x, w).compile(), dict(mesh.shape))
    for op in report["collective_ops"]:
        if op["wire_bytes"] > 1000:
            print(f"    {op['kind']:18s} {op['shape'].split('{')[0]:18s} over "
                  f"{','.join(op['axes']) or '(permute)':8s} x{op['count']:.0f}")
    return sum(report["collectives_wire"].values())


def main() -> None:
    auto = AxisType.Auto
    q = 2
    cases = [
        ("2-D (Optimus) on 2x2", jax.make_mesh((2, 2), ("r", "c"), axis_types=(auto,) * 2,
                                               devices=jax.devices()[:4]),
         P("r", "c"), P("r", "c"), P("r", "c"), 2 * (q - 1) / q**2 * (T * K + K * N)),
        ("3-D (Bian et al.) on 2x2x2", jax.make_mesh((2, 2, 2), ("x", "y", "z"),
                                                     axis_types=(auto,) * 3),
         P(("x", "y"), "z"), P(("z", "x"), "y"), P(("x", "z"), "y"),
         2 * (q - 1) / q**3 * (T * K + K * N + T * N)),
    ]
    print(f"Y[{T},{N}] = X[{T},{K}] W[{K},{N}], float32, forward + backward; "
          "wire bytes received per device")
    for name, mesh, xs, ws, ys, formula in cases:
        print(f"{name}: X {xs}, W {ws}, Y {ys}")
        print("  GSPMD, annotations only:")
        a = measure(mesh, xs, ws, ys, explicit=False)
        print("  shard_map gathered_matmul:")
        b = measure(mesh, xs, ws, ys, explicit=True)
        f = formula * 4
        print(f"  formula {f / 1e6:.3f} MB | GSPMD {a / 1e6:.3f} MB ({a / f:.2f}x) | "
              f"shard_map {b / 1e6:.3f} MB ({b / f:.2f}x)\n")


if __name__ == "__main__":
    run_script(main)
