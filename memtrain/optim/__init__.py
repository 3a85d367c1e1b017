"""The optimizers: optimizer state off the device, lean moments, step in backward, partial offload, the byte model.

- ``host_buffers``: the offloaded optimizer's pinned flat buffers, per-parameter slots, buckets, host-RAM check.
- ``gradient_landing``: backward streams each gradient device -> host as it is ready (CPUOffloadOptimizer's half).
- ``host_gradients``: its host gradients normalised, clipped, checked for inf/NaN with no pass over them.
- ``offload_checkpoint``: CPUOffloadOptimizer's state_dict keyed by parameter name.
- ``offload``: CPUOffloadOptimizer, fp32 masters and fp32, bf16 or int8 moments on the CPU, the step overlapped
  with GPU work.
- ``moments``: AdamW's moments in bf16 (stochastic rounding) or int8 (bitsandbytes), converting between them.
- ``memory``: the byte model (optimizer_memory), which parameters go to the host, the host step's rate.
- ``in_backward``: each parameter steps as its gradient is final (lagged clipping, the inf flag on the device).
- ``partial``: the host part of a partly offloaded AdamW, normalised and clipped with the device part.
- ``composed``: ComposedOptimizer, one torch optimizer combining the options; ``build``: build_optimizer.
- ``pure_bf16``: PureBF16AdamW, bf16 weights with no fp32 master, updates rounded stochastically (unbiased).
"""

from memtrain.optim.build import build_optimizer
from memtrain.optim.composed import ComposedOptimizer
from memtrain.optim.memory import (
    OptimizerMemory,
    cpu_step_rate,
    host_step_probe,
    offloaded_mask,
    optimizer_memory,
)
from memtrain.optim.moments import (
    BF16_CHUNK,
    INT8_DEVICES,
    BF16StateAdamW,
    adamw_8bit_class,
    moments_of,
    precision_of,
)
from memtrain.optim.offload import CPUOffloadOptimizer
from memtrain.optim.pure_bf16 import PureBF16AdamW, stochastic_round_to_bf16
from memtrain.techniques.optimizer import (  # the setting's values, declared there
    STATE_PRECISIONS,
    StatePrecision,
)

__all__ = [
    "BF16_CHUNK",
    "INT8_DEVICES",
    "STATE_PRECISIONS",
    "BF16StateAdamW",
    "CPUOffloadOptimizer",
    "ComposedOptimizer",
    "OptimizerMemory",
    "PureBF16AdamW",
    "StatePrecision",
    "adamw_8bit_class",
    "build_optimizer",
    "cpu_step_rate",
    "host_step_probe",
    "moments_of",
    "offloaded_mask",
    "optimizer_memory",
    "precision_of",
    "stochastic_round_to_bf16",
]
