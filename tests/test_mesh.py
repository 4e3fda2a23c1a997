import pytest
from helpers import ROOT

from plait import mesh as M
from plait.errors import UserError


def test_inline_and_minus_one():
    spec = M.load_spec("data=2,fsdp=-1,tensor=2")
    assert M.resolve(spec, 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert M.resolve(M.load_spec("tensor=-1"), 8) == {"data": 1, "fsdp": 1, "tensor": 8}
    assert M.inline({"data": 2, "fsdp": 1, "tensor": 4}) == "data=2,tensor=4"


def test_mesh_files_load():
    for path in (ROOT / "meshes").glob("*.toml"):
        spec = M.load_spec(str(path))
        M.check_axes(spec)


@pytest.mark.parametrize("spec,n,message", [
    ("data=3", 8, r"needs 3 devices but 8"),
    ("date=8", 8, r"unknown mesh axis 'date'.*did you mean 'data'"),
    ("pipeline=2,data=4", 8, r"'pipeline' \(pipeline parallelism\) is not implemented yet"),
    ("tensor_x=2,tensor_y=2,tensor_z=2", 8, r"'tensor_x' \(3-D tensor parallelism\)"),
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


def test_missing_mesh_file():
    with pytest.raises(UserError, match=r"mesh file 'meshes/nope.toml' not found"):
        M.load_spec("meshes/nope.toml")


def test_more_devices_than_accelerators_exist(monkeypatch):
    import jax

    class FakeGPU:
        platform = "gpu"

    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGPU()] * 4)
    with pytest.raises(UserError, match=r"needs 8 devices but only 4 gpu devices exist"):
        M.provision_devices(M.load_spec("data=2,tensor=4"))
    # -1 takes every accelerator.
    assert M.provision_devices(M.load_spec("data=-1")) == 4
