import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # dist_workers, importable by spawned workers


@pytest.fixture
def world_of_one(tmp_path):
    """A one-process gloo group, for tests of the distributed code's single-rank behaviour."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
