import pytest
from helpers import ROOT, FakeGPU

from plait import mesh as M
from plait.errors import UserError


def test_inline_and_minus_one():
    def used(sizes):
        return {a: s for a, s in sizes.items() if s != 1}

    spec = M.load_spec("data=2,fsdp=-1,tensor=2")
    assert used(M.resolve(spec, 8)) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert used(M.resolve(M.load_spec("tensor=-1"), 8)) == {"tensor": 8}
    assert used(M.resolve(M.load_spec("tensor_x=2,tensor_y=2,tensor_z=-1"), 8)) == \
        {"tensor_x": 2, "tensor_y": 2, "tensor_z": 2}
    assert M.inline({"data": 2, "fsdp": 1, "tensor": 4}) == "data=2,tensor=4"


def test_mesh_files_load():
    for path in (ROOT / "meshes").glob("*.toml"):
        spec = M.load_spec(str(path))  # checked when made
        if -1 not in spec.axes.values():
            M.resolve(spec, M.fixed_product(spec))


@pytest.mark.parametrize("spec,n,message", [
    ("data=3", 8, r"needs 3 devices but 8"),
    ("date=8", 8, r"unknown mesh axis 'date'.*did you mean 'data'"),
    ("tensor_x=2,tensor_y=2,tensor_z=1,data=2", 8, r"is not a cube"),
    ("tensor_row=4,tensor_col=2", 8, r"is not square"),
    ("tensor_depth=2,tensor_row=1,data=4", 8, r"stacks 2-D grids"),
    ("tensor=2,tensor_x=2,tensor_y=2,tensor_z=2", 16, r"mixes tensor modes"),
    ("data=-1,fsdp=-1", 8, r"only one mesh axis may be -1"),
    ("data=3,fsdp=-1", 8, r"fixed axes multiply to 3"),
    ("data=2;fsdp=4", 8, r"cannot read mesh spec"),
    ("data=0", 8, r"size 0"),
])
def test_bad_meshes(spec, n, message):
    with pytest.raises(UserError, match=message):
        M.resolve(M.load_spec(spec), n)


def test_future_axes_at_size_one_are_accepted():
    assert M.resolve(M.load_spec("data=8,pipeline=1,tensor_row=1"), 8)["data"] == 8


@pytest.mark.parametrize("spec,mode", [
    ("data=8", None), ("tensor=8", "1d"), ("data=2,tensor_row=2,tensor_col=2", "2d"),
    ("tensor_depth=2,tensor_row=2,tensor_col=2", "2.5d"),
    ("tensor_x=2,tensor_y=2,tensor_z=2", "3d"),
])
def test_tensor_mode_of_a_mesh(spec, mode):
    assert M.tensor_mode(M.resolve(M.load_spec(spec), 8)) == mode


def test_missing_mesh_file():
    with pytest.raises(UserError, match=r"mesh file 'meshes/nope.toml' not found"):
        M.load_spec("meshes/nope.toml")


@pytest.mark.parametrize("text,message", [
    ("[mesh]\n", "has an empty [mesh] table; give the axis sizes"),  # had run on one device
    ("[mesh]\ndata = true\n", "axis 'data' must be an integer, got true"),
    ("[mesh]\ndata = 2.0\n", "axis 'data' must be an integer, got 2.0"),
])
def test_mesh_file_mistakes_are_one_line(tmp_path, text, message):
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        M.load_spec(str(path))
    assert message in str(e.value), e.value


def test_more_devices_than_accelerators_exist(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGPU()] * 4)
    with pytest.raises(UserError, match=r"needs 8 devices but only 4 gpu devices exist"):
        M.provision_devices(M.load_spec("data=2,tensor=4"))
    # -1 takes every accelerator.
    assert M.provision_devices(M.load_spec("data=-1")) == 4


def test_processes_that_cannot_share_the_mesh_equally_are_refused(monkeypatch):
    """plait launch --processes 3 on a mesh of 8: each process simulated 2 CPU devices
    and the run ended in "needs 8 devices but this process has 6"; with 16, one each,
    and the 8 processes outside the mesh hung until the others lost them."""
    monkeypatch.setattr(M, "_PENDING_PROCESSES", 3)
    with pytest.raises(UserError, match=r"mesh data=8 needs 8 devices, which 3 processes "
                       r"cannot share equally .*; use a process count that divides 8 "
                       r"\(2, 4, 8\)"):
        M.provision_devices(M.load_spec("data=8"))
    monkeypatch.setattr(M, "_PENDING_PROCESSES", 16)
    with pytest.raises(UserError, match=r"which 16 processes cannot share"):
        M.provision_devices(M.load_spec("data=8"))
    monkeypatch.setattr(M, "_PENDING_PROCESSES", 2)
    assert M.provision_devices(M.load_spec("data=8")) == 8
    # a -1 axis takes a device per core, rounded up to an equal share for each process
    monkeypatch.setattr(M.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(M, "_PENDING_PROCESSES", 3)
    assert M.provision_devices(M.load_spec("data=-1")) == 6


def test_experiment_mesh_falls_back_to_cpu_devices_where_accelerators_are_fewer(
        monkeypatch, capsys):
    """The quickstart's own mesh (8 devices) on a one-GPU machine runs on simulated CPU
    devices with a one-line notice; an explicit --mesh that does not fit stays an error."""
    import jax

    real = jax.devices

    class OneGPU:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(jax, "devices", lambda backend=None: [OneGPU()] if backend is None
                        else real(backend))
    explicit = M.MeshSpec({"data": 2, "fsdp": 2, "tensor": 2}, "--mesh")
    with pytest.raises(UserError, match=r"needs 8 devices but only 1 gpu devices exist"):
        M.provision_devices(explicit)
    own = M.MeshSpec({"data": 2, "fsdp": 2, "tensor": 2}, "[mesh] of quickstart.toml",
                     cpu_fallback=True)
    try:
        assert M.provision_devices(own) == 8
        note = capsys.readouterr().err.strip().splitlines()
        assert len(note) == 1 and "running it on 8 simulated CPU devices" in note[0]
        mesh = M.build_mesh(M.resolve(own, 8), 8)
        assert {d.platform for d in mesh.devices.flat} == {"cpu"}
    finally:
        monkeypatch.setattr(M, "_ON_CPU", False)
