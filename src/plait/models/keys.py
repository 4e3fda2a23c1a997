"""Parameter keys for model constructors, without a stateful RNG variable.

`nnx.Rngs` keeps its counter in a Variable; under `eval_shape` every update of
that Variable makes flax ask the tracer for its `.sharding`, and JAX builds an
error message by walking the whole jaxpr each time: building a 64-layer
model's shapes took seconds, quadratic in depth. The same keys
(`fold_in(key(seed), count)`, as `nnx.Rngs(params=seed).params()` yields them)
from a Python counter cost nothing.
"""

from __future__ import annotations

import jax


class ParamKeys:
    """Successive parameter keys: fold_in(key(seed), 0), fold_in(key(seed), 1), ...

    `start` (a Python or traced integer) begins the count elsewhere: a stacked
    layer's init, vmapped over layer indices, draws the keys that layer would
    draw were the layers built one after another.
    """

    def __init__(self, seed: int | jax.Array, start: int | jax.Array = 0):
        self.key = jax.random.key(seed) if isinstance(seed, int) else seed
        self.count = start

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self.key, self.count)
        self.count += 1
        return key
