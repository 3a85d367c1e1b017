"""Activation offload: the tensors autograd saves for backward wait in host memory instead of on the device.

- ``transport``: the device-specific half over the device seam (``Transport``: pinned slabs, one side stream;
  ``CpuTransport``: plain copies);
- ``host_pool``: ``HostPool``, fixed-size pinned slabs under a host-RAM budget, reused every step;
- ``saved``: what autograd holds for an offloaded tensor, the counters, and which saved tensors stay on the device;
- ``offloader``: ``ActivationOffloader`` (the saved-tensor hooks, prefetch, the pool) and ``offload_activations``;
- ``weights``: ``WeightStreamer``, parameter offload: the blocks' weights in host memory, on the device only while
  in use (one block ahead).
"""

from memtrain.offload.host_pool import SLAB_BYTES_DEFAULT, HostPool
from memtrain.offload.offloader import MIN_BYTES_DEFAULT, ActivationOffloader, offload_activations
from memtrain.offload.saved import OffloadStats, derived_from_leaf, find_output_head
from memtrain.offload.transport import CpuTransport, Segments, Transport
from memtrain.offload.weights import PREFETCH_DEFAULT, WeightStats, WeightStreamer

__all__ = [
    "MIN_BYTES_DEFAULT",
    "SLAB_BYTES_DEFAULT",
    "ActivationOffloader",
    "CpuTransport",
    "HostPool",
    "OffloadStats",
    "PREFETCH_DEFAULT",
    "Segments",
    "Transport",
    "WeightStats",
    "WeightStreamer",
    "derived_from_leaf",
    "find_output_head",
    "offload_activations",
]
