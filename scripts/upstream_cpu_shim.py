"""Run upstream torchtitan 0.2.2's trainer on a CPU (scripts/compare_upstream.py --device cpu).

Upstream has no CPU training path: with no accelerator it picks ``cuda`` (``get_device_info``),
needs ``torch.cuda``-only memory calls, and imports triton for its MoE kernels at import. This
entry point, started by torchrun in place of ``-m torchtitan.train``, makes it see the CPU as
its device and leaves the rest untouched. The numbers it gives are a smoke test of the
comparison, never a measurement (upstream's memory reads -1 and its MFU uses A100's peak).
"""

import runpy
import sys
import types

import torch
import torch._utils

try:
    import triton  # noqa: F401
except ImportError:  # a stand-in for the MoE kernels module; a dense model never calls it
    kernels = types.ModuleType("torchtitan.models.moe.kernels")

    def _needs_triton(*args, **kwargs):
        raise NotImplementedError("upstream's MoE kernels need triton")

    kernels.generate_permute_indices = kernels.fill_indices_wrapper = _needs_triton
    sys.modules[kernels.__name__] = kernels


class _Properties:
    total_memory = 1 << 40


torch._utils._get_available_device_type = lambda: "cpu"
torch.cpu.current_device = lambda: 0  # upstream passes it to barrier(device_ids=[...])
for _name, _fn in {
    "get_device_name": lambda *a: "cpu",
    "get_device_properties": lambda *a: _Properties(),
    "memory_stats": lambda *a: {},
    "reset_peak_memory_stats": lambda *a: None,
    "empty_cache": lambda: None,
}.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _fn)

sys.argv[0] = "torchtitan.train"
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
