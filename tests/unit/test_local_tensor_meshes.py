"""COMM_MODE=local_tensor: LocalTensorMode's per-mesh coordinate cache must not outlive a mesh;
the simulation computes with one real rank's CPU threads.

torch keys the cache by ``id(mesh)``; the simulated data parallel builds a mesh per parameter,
and a later mesh at a freed one's address got its coordinates (a flaky IndexError in
``distribute_tensor``, seen in CI). The eviction drops the entry when the mesh is freed.
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def test_local_tensor_mode_forgets_the_coordinates_of_freed_meshes():
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.comm_mode.fake_backend import init_fake_process_group
    from torchtitan.distributed.comm_mode.local_tensor import evict_dead_mesh_coordinates

    evict_dead_mesh_coordinates()
    evict_dead_mesh_coordinates()  # idempotent: one eviction per mesh
    init_fake_process_group(4)
    try:
        with LocalTensorMode(4) as mode:
            root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
            kept = root["a"]
            kept.get_coordinate()
            freed = root["b"]
            freed.get_coordinate()
            freed_id = id(freed)
            assert {id(kept), freed_id} <= set(mode._coordinate_cache)
            del freed
            gc.collect()
            assert freed_id not in mode._coordinate_cache
            assert id(kept) in mode._coordinate_cache  # live meshes keep theirs
    finally:
        dist.destroy_process_group()


def test_simulation_uses_the_threads_of_one_real_cpu_rank(monkeypatch):
    """run_train.sh gives each real CPU rank cores / NGPU threads; the simulation computes with
    as many, so its kernels round like the real ranks' (with 2 threads on a 2-core machine the
    TP2 x FSDP2 step-1 loss came out 4.6e-7 off in some runs)."""
    import os

    import torch

    from torchtitan.distributed.comm_mode import local_tensor

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert local_tensor.real_rank_threads(4) == 2
    assert local_tensor.real_rank_threads(16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert local_tensor.real_rank_threads(4) is None  # the user's setting stands


def test_a_nan_on_every_simulated_rank_reads_as_nan_and_a_bad_shard_is_found():
    """The finite check's host copy of a NaN loss under COMM_MODE=local_tensor: LocalTensor's
    own float() compares the ranks' values, and NaN equals nothing (it raised instead of the
    one error line). A non-finite value on one simulated rank's shard is found."""
    import math

    import torch
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from torchtitan.distributed.utils import all_finite, scalar_value

    with LocalTensorMode(2):
        nan = LocalTensor({0: torch.tensor(float("nan")), 1: torch.tensor(float("nan"))})
        assert math.isnan(scalar_value(nan))
        assert scalar_value(LocalTensor({0: torch.tensor(2.5), 1: torch.tensor(2.5)})) == 2.5
        assert not all_finite(LocalTensor({0: torch.ones(2), 1: torch.tensor([1.0, math.inf])}))
        assert all_finite(LocalTensor({0: torch.ones(2), 1: torch.ones(2)}))
