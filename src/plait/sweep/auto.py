"""`plait train --mesh auto`: sweep the devices at hand (or read the cached ranking)
and train on the best shape that fits."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from plait import cluster
from plait.errors import UserError


def auto_mesh(args, exp):
    """`--mesh auto`: sweep the devices at hand and take the best shape that fits."""
    import jax

    from plait import hardware, sweep
    from plait import mesh as mesh_lib

    cluster.join(args)
    n = mesh_lib.provision_devices(mesh_lib.MeshSpec({"data": -1}, "--mesh auto"), args.devices)
    hw_name = hardware.for_device(jax.devices()[0].device_kind)
    cache = _cache_path(exp, n, hw_name)
    rows = _read_cache(cache)
    if rows is not None:
        print(f"plait: --mesh auto: the ranking of {n}-device shapes on {hw_name} from "
              f"{cache} (delete it to sweep again)", flush=True)
    else:
        print(f"plait: --mesh auto: compiling the {n}-device mesh shapes to rank them on "
              f"{hw_name} before training (once; the ranking is cached; pass --mesh to skip)",
              flush=True)
        rows = sweep.run_sweep(exp, n, hardware.load_hardware(hw_name),
                               workers=None if _simulated(jax) else 1)
        _write_cache(cache, rows)
    best = next((r for r in rows if r["fits"]), None)
    if best is None:
        raise UserError(f"--mesh auto: no shape of {n} devices fits {hw_name}'s memory; "
                        "shrink the model or the batch, or use more devices")
    cand = sweep.candidate_of(best, n)
    pipe = cand.pipeline
    print(f"plait: --mesh auto chose {best['mesh']}"
          + (f" ({pipe['schedule']}, {pipe['microbatches']} microbatches)" if pipe else "")
          + f" of {len(rows)} shapes on {hw_name} "
          f"(predicted {best['predicted_step_s']:.3g} s/step)",
          flush=True)
    return cand.experiment(exp), mesh_lib.build_mesh(cand.sizes, n)


def _simulated(jax) -> bool:
    """Whether the sweep may compile in worker processes as `plait sweep` does (each
    simulating the same n CPU devices: the same programs, about 2x sooner on 2 cores;
    the quickstart's 69 programs took 6 minutes in this process): only for one process
    on CPUs. An accelerator is not shared with other processes, and the processes of a
    multi-process run would each start a pool on one host: those compile here, on the
    devices they train on."""
    return jax.process_count() == 1 and jax.devices()[0].platform == "cpu"


def _cache_path(exp, n: int, hw_name: str) -> Path:
    """Where `--mesh auto` keeps its ranking: one file per (experiment as resolved,
    device count, hardware, plait's sources and JAX's version), under
    $XDG_CACHE_HOME/plait. The sources, not plait's version number: a checkout that
    changes how the sweep prices (same version) must not reuse an older ranking."""
    import hashlib

    from plait.sweep.journal import sources_digest

    key = "\n".join([exp.to_toml(), str(n), hw_name, sources_digest()])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plait"
    return root / "mesh-auto" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_cache(path: Path) -> list[dict] | None:
    """The cached ranking, or None (none yet, or unreadable: then it is swept again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_cache(path: Path, rows: list[dict]) -> None:
    """Written whole or not at all (processes of one run may write it at once); a cache
    that cannot be written is no error."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(rows))
        tmp.replace(path)
