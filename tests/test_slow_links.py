"""Meshes that know their slow links: axes (or parts of axes) across hosts, the device
layout that puts them there, collectives classed by the links they cross, and the
hierarchical reduction that sends 1/fast of the gradients across hosts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import losses, make_mesh, run, tiny
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from plait import analysis, hosts
from plait import mesh as mesh_lib
from plait.errors import UserError
from plait.inspect import inspect_step
from plait.parallel import hierarchical


def test_dcn_parts_multiply_into_the_axis_and_lay_hosts_out_in_blocks(tmp_path):
    spec = mesh_lib.load_spec("data=2@dcn,data=2,fsdp=2")
    assert spec.dcn == {"data": 2} and spec.hosts == 2
    sizes = mesh_lib.resolve(spec, 8)
    assert (sizes["data"], sizes["fsdp"]) == (4, 2)
    mesh = make_mesh("data=2@dcn,data=2,fsdp=2")
    layout = hosts.host_layout(mesh).reshape(4, 2)
    # The data axis's outer 2 are hosts; each host holds 4 consecutive devices.
    np.testing.assert_array_equal(layout, [[0, 0], [0, 0], [1, 1], [1, 1]])
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
    assert set(ids[:2].ravel()) == {0, 1, 2, 3}
    assert hosts.axis_split(mesh, "data") == (2, 2)
    assert hosts.axis_split(mesh, "fsdp") == (1, 2)
    assert hosts.mesh_text(mesh) == "data=2@dcn,data=2,fsdp=2"
    # An inner axis across hosts: fsdp's 2 are the hosts, data stays within each.
    inner = make_mesh("fsdp=2@dcn,data=4")
    assert hosts.axis_split(inner, "data") == (1, 4)
    assert hosts.axis_split(inner, "fsdp") == (2, 1)
    # A mesh file says the same with a [mesh.dcn] table.
    f = tmp_path / "two-hosts.toml"
    f.write_text("[mesh]\ndata = 2\nfsdp = 2\n[mesh.dcn]\ndata = 2\n")
    assert mesh_lib.load_spec(str(f)).dcn == {"data": 2}
    # Without a dcn part every device is on one host again.
    assert hosts.axis_split(make_mesh("data=4,fsdp=2"), "data") == (1, 4)


@pytest.mark.parametrize("text,needle", [
    ("data=-1@dcn,fsdp=2", "across hosts has size -1"),
    ("data=2@dcn,data=2@dcn,fsdp=2", "across hosts (@dcn) twice"),
    ("dta=2@dcn,data=4", "did you mean 'data'"),
    ("data=2@dnc,data=4", "cannot read mesh spec"),
])
def test_bad_dcn_specs_are_refused_in_one_line(text, needle):
    with pytest.raises(UserError) as e:
        mesh_lib.load_spec(text)
    assert needle in str(e.value)


def test_a_dcn_part_that_does_not_divide_its_axis_is_refused():
    with pytest.raises(UserError, match="cannot have 4 of it across hosts"):
        mesh_lib.build_mesh({"data": 2, "fsdp": 4}, 8, {"data": 4})


def _bucket_program(split):
    mesh = make_mesh("data=2@dcn,data=4")
    x = jax.device_put(jnp.arange(8 * 1000, dtype=jnp.float32).reshape(8, 1000),
                       NamedSharding(mesh, P("data")))
    fn = jax.jit(lambda g: hierarchical.mean_over_data({"w": g}, {"w": P()}, mesh, split))
    compiled = fn.lower(x).compile()
    report = analysis.analyze(compiled, dict(mesh.shape), None,
                              hosts.host_layout(mesh).ravel())
    return np.asarray(fn(x)["w"]), report, np.asarray(x).mean(0)


def test_hierarchical_reduction_sends_one_fast_part_of_the_flat_bytes_across_hosts():
    flat_out, flat, want = _bucket_program((8, 1))
    hier_out, hier, _ = _bucket_program((2, 4))
    np.testing.assert_allclose(flat_out, want, rtol=1e-6)
    np.testing.assert_allclose(hier_out, want, rtol=1e-6)
    assert flat["bytes_by_link"] == {"within_host": 0.0, "across_hosts": 4000.0}
    # Reduce-scatter and all-gather within the hosts, 1/4 of the bytes across.
    assert hier["bytes_by_link"]["across_hosts"] == 4000.0 / 4
    kinds = {(o["kind"], o["group_size"], o["crosses_hosts"]) for o in hier["collective_ops"]}
    assert kinds == {("reduce-scatter", 4, False), ("all-gather", 4, False),
                     ("all-reduce", 2, True)}


@pytest.mark.parametrize("spec", ["data=2@dcn,data=4", "data=2@dcn,data=2,fsdp=2",
                                  "data=2@dcn,data=2,tensor=2"])
def test_hierarchical_losses_equal_the_flat_run(spec, tmp_path):
    ref = losses(run(tiny(sync={"reduce": "flat"}), spec, tmp_path / "flat"))
    got = losses(run(tiny(sync={"reduce": "hierarchical"}), spec, tmp_path / "hier"))
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_the_step_sends_the_gradients_over_a_fast_part_across_hosts():
    """As plait inspect reports it: the flat step all-reduces (at least) the gradients
    across hosts, the hierarchical one the gradients / 4 and the loss."""
    mesh = make_mesh("data=2@dcn,data=4")
    flat = inspect_step(tiny(sync={"reduce": "flat"}), mesh)
    hier = inspect_step(tiny(sync={"reduce": "auto"}), mesh)
    grads = hier["param_bytes_per_device"]
    assert flat["bytes_by_link"]["within_host"] == 0.0
    assert flat["bytes_by_link"]["across_hosts"] >= grads
    assert hier["bytes_by_link"]["across_hosts"] == grads / 4 + 4  # + the f32 loss
    assert hier["bytes_by_link"]["within_host"] == 2 * grads  # reduce-scatter + all-gather


@pytest.mark.parametrize("method", ["easgd", "diloco"])
def test_local_sgd_exchange_goes_across_hosts_once_per_host(method, tmp_path):
    spec = "data=2@dcn,data=2,fsdp=2"
    mesh = make_mesh(spec)
    sync = {"method": method, "period": 2}
    flat = inspect_step(tiny(sync={**sync, "reduce": "flat"}), mesh)["phases"]["sync_step"]
    hier = inspect_step(tiny(sync=sync), mesh)["phases"]["sync_step"]
    across = flat["bytes_by_link"]["across_hosts"]
    assert across > 0
    assert hier["bytes_by_link"]["across_hosts"] == across / 2
    if method == "diloco":
        return  # the exchange code is the one easgd trains through below (suite time)
    ref = losses(run(tiny(sync={**sync, "reduce": "flat"}, train={"steps": 6}), spec,
                     tmp_path / "flat"))
    got = losses(run(tiny(sync=sync, train={"steps": 6}), spec, tmp_path / "hier"))
    np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.parametrize("spec,sections,needle", [
    ("data=8", {}, "does not have parts both across and within hosts"),
    ("data=2@dcn,data=2,pipeline=2", {"pipeline": {"microbatches": 2}}, "pipeline"),
])
def test_what_hierarchical_reduction_does_not_run_is_refused_in_one_line(spec, sections,
                                                                         needle):
    from plait.tasks.gpt import GPTTask

    with pytest.raises(UserError, match=needle):
        GPTTask(tiny(sync={"reduce": "hierarchical"}, **sections), make_mesh(spec))
