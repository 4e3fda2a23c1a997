"""The only code in plait that writes explicit collectives (inside `jax.shard_map`)."""
