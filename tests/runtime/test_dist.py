"""Where a mesh keeps its tensors, whatever process group it is made over."""

import subprocess
import sys
import textwrap


def test_fake_process_group_keeps_the_gpu():
    """Torch's fake process group (a faked world of N ranks in one process, for memory at a
    larger world size) keeps a GPU mesh on the GPU; gloo stays on the CPU. CUDA is stood in
    for, since the mesh's device type is decided before any tensor moves."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from autoshard.runtime import dist as adist
        torch.cuda.is_available = lambda: True
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        fake = adist.mesh_device_type()
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        gloo = adist.mesh_device_type()
        dist.destroy_process_group()
        print(fake, gloo)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cuda", "cpu"]


def test_host_shards_stay_on_the_host_of_a_gpu_mesh():
    """CPU offload on a GPU: ``storage.place`` moves a shard to host memory and the
    parameter must stay there (``DTensor.from_local`` would move it back to the mesh's
    device, and the host gradient could then not be assigned). A mesh of device type cuda
    stands in for the GPU: on a machine without one, moving anything to it fails."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        from autoshard.core import _compat
        from autoshard.runtime import storage
        from autoshard.core.spec import ON_HOST
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
        w = torch.randn(4, 3)
        p = torch.nn.Parameter(_compat.dtensor_here(w.clone(), mesh, [Shard(0)], w.shape,
                                                    w.stride()))
        p.mine = 1
        opt = torch.optim.SGD([p], lr=0.5)
        model = torch.nn.Module()
        model.w = p
        spec = type("Spec", (), {"device": "host", "fqn": "w"})()
        assert storage.move_to_host(model, [spec], torch.device("cpu"), pin=False) == ["w"]
        assert model.w is p and opt.param_groups[0]["params"][0] is p and p.mine == 1
        assert getattr(p, ON_HOST) and p.device_mesh.device_type == "cuda"
        assert p.device.type == "cpu" and p.to_local().device.type == "cpu"
        p.grad = _compat.dtensor_like(p, torch.ones(4, 3))
        opt.step()
        assert torch.equal(p.to_local(), w - 0.5)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]


def test_a_process_group_made_again_shards_on_its_own_groups():
    """A process that destroys its process group and initialises another (a notebook that
    starts over) shards on the new group's meshes: DTensor's caches compare meshes by value,
    and kept the first mesh, whose groups are gone, for the parameters and gradients made on
    the second. Three groups made first give the second mesh's groups other names. Torch's
    fake process group stands in for 4 ranks."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import autoshard

        def shard(extra):
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
            for _ in range(extra):
                dist.new_group([0, 1, 2, 3])
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            torch.manual_seed(0)
            model = autoshard.autoshard(torch.nn.Sequential(torch.nn.Linear(8, 8)), mesh=mesh)
            model(torch.randn(2, 8)).sum().backward()
            names = [mesh.get_group(d).group_name for d in range(2)]
            for t in [*model.parameters(), *(p.grad for p in model.parameters())]:
                got = [t.device_mesh.get_group(d).group_name for d in range(2)]
                assert got == names, (got, names)
                t.full_tensor()
            dist.destroy_process_group()
            return names

        print(shard(0) != shard(3))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True"
