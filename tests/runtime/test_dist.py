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
