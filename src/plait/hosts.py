"""Which host each device of a mesh sits on: axes laid out across hosts, read back.

A mesh spec's `@dcn` parts (plait.mesh) say which part of each axis crosses
hosts; `place` lays the devices out so that part is the outer part of its axis
(what `jax.experimental.mesh_utils.create_hybrid_device_mesh` does for slices
or processes; a one-process simulation has neither, so plait groups
consecutive devices into simulated hosts). Everything downstream reads the
layout back from the mesh (`host_layout`, `axis_split`), never from the spec:
a two-process run whose data axis crosses the processes is split by hosts
whether or not it said `@dcn`.
"""

from __future__ import annotations

import math

import numpy as np

from plait.errors import UserError

# Simulated hosts of a one-process run: device id -> host, set by `place`.
_SIMULATED_HOST: dict[int, int] = {}


def place(sizes: dict[str, int], devices: list, dcn: dict[str, int]) -> np.ndarray | None:
    """The devices arranged as the mesh `sizes`, each axis = (its part across hosts in
    `dcn`, its rest), or None when no part crosses hosts (the devices in order). Hosts
    are the processes of a multi-process run; in one process, groups of consecutive
    devices, recorded as simulated hosts (what `host_layout` then reports)."""
    import jax

    names = tuple(sizes)
    dcn = {a: s for a, s in dcn.items() if s > 1}
    one_process = jax.process_count() == 1
    if one_process:
        for d in devices:
            _SIMULATED_HOST.pop(d.id, None)
    if not dcn:
        return None
    hosts = math.prod(dcn.values())
    text = ",".join(f"{a}={s}@dcn" for a, s in dcn.items())
    for a, s in dcn.items():
        if sizes.get(a, 1) % s:
            raise UserError(f"mesh axis '{a}' of size {sizes.get(a, 1)} cannot have {s} of it "
                            f"across hosts; make {s} divide it")
    if one_process:  # each part divides its axis, so the hosts divide the devices
        per = len(devices) // hosts
        groups = [devices[h * per:(h + 1) * per] for h in range(hosts)]
        for h, group in enumerate(groups):
            for d in group:
                _SIMULATED_HOST[d.id] = h
    else:
        by_process: dict[int, list] = {}
        for d in devices:
            by_process.setdefault(d.process_index, []).append(d)
        if len(by_process) != hosts:
            raise UserError(f"{text} spans {hosts} hosts but the run has {len(by_process)} "
                            "processes (one per host); make the @dcn parts multiply to it")
        groups = [by_process[k] for k in sorted(by_process)]
    ici = [sizes[a] // dcn.get(a, 1) for a in names]
    outer = [dcn.get(a, 1) for a in names]
    blocks = np.empty((hosts, math.prod(ici)), dtype=object)
    for h, group in enumerate(groups):
        if len(group) != blocks.shape[1]:
            raise UserError(f"host {h} has {len(group)} devices and {text} needs "
                            f"{blocks.shape[1]} on each; give every host as many devices")
        blocks[h, :] = group
    # [host coords..., device-in-host coords...] -> each axis = (its dcn part, its rest).
    k = len(names)
    arr = blocks.reshape(outer + ici).transpose(
        [i for pair in zip(range(k), range(k, 2 * k), strict=True) for i in pair])
    return arr.reshape(tuple(sizes[a] for a in names))


def host_of(device) -> int:
    """The host a device sits on: its process in a multi-process run, else its
    simulated host (0 unless the mesh declared parts across hosts)."""
    import jax

    if jax.process_count() > 1:
        return int(device.process_index)
    return _SIMULATED_HOST.get(device.id, 0)


def host_layout(mesh) -> np.ndarray:
    """The host of every mesh position, shaped like the mesh."""
    return np.vectorize(host_of, otypes=[int])(mesh.devices)


def axis_split(mesh, axis: str) -> tuple[int, int]:
    """(slow, fast): how many hosts a line along `axis` crosses and how many of its
    devices share each host, when every line is laid out host after host in equal
    blocks (what `build_mesh` makes); (1, size) for an axis within one host. An
    irregular layout reads as all slow, (size, 1)."""
    if axis not in mesh.shape:
        return 1, 1
    size = mesh.shape[axis]
    hosts = np.moveaxis(host_layout(mesh), list(mesh.shape).index(axis), 0).reshape(size, -1)
    slow = len(set(hosts[:, 0].tolist()))
    if size % slow:
        return size, 1
    fast = size // slow
    blocks = hosts.reshape(slow, fast, -1)
    same_within = bool((blocks == blocks[:, :1]).all())
    distinct = all(len(set(blocks[:, 0, j].tolist())) == slow for j in range(hosts.shape[1]))
    return (slow, fast) if same_within and distinct else (size, 1)


def mesh_text(mesh) -> str:
    """The `--mesh` form of a built mesh, with the parts across hosts as `@dcn`."""
    parts = []
    for a, size in mesh.shape.items():
        if size == 1:
            continue
        slow, fast = axis_split(mesh, a)
        parts += [f"{a}={slow}@dcn"] * (slow > 1) + [f"{a}={fast}"] * (fast > 1)
    return ",".join(parts) or "data=1"


def hosts_text(mesh) -> str:
    """', 3 simulated hosts' / ', 2 hosts' / '' for the header line."""
    import jax

    n = len(set(host_layout(mesh).ravel().tolist()))
    if n == 1:
        return ""
    return f", {n} hosts" if jax.process_count() > 1 else f", {n} simulated hosts"


def dcn_for(sizes: dict[str, int], hosts: int) -> dict[str, int] | None:
    """The parts across `hosts` hosts of a mesh laid out in order (outer axes first
    across hosts: what a sweep's hardware with `devices_per_node` means), or None when
    the axes do not split that way."""
    left, dcn = hosts, {}
    for a, s in sizes.items():
        if left == 1:
            break
        if s == 1:
            continue
        part = s if left % s == 0 else left if s % left == 0 else 0
        if not part:
            return None
        dcn[a] = part
        left //= part
    return dcn if left == 1 else None
