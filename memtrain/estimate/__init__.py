"""Predict the peak memory of a training step without running it: no GPU, no real activations.

The model's forward and backward run on tensors without data (meta tensors for a CUDA target; fake CPU tensors,
``torch._subclasses.FakeTensorMode``, for a CPU target), so a 70B Llama config costs seconds and no memory. Two
things are counted along the way:

- the tensors autograd saves for backward, by the same ``MemoryMeter`` that ``measure`` uses, so on the CPU the
  figure equals ``measure``'s exactly;
- every tensor alive at every moment (a dispatch mode sees each allocation, a weak reference each free), which
  gives the peak of the step and the tensors that make it, as the device allocator would see them.

For ``device="cuda"`` the simulation runs with the CPU's kernels but CUDA's rules where they change memory: the
CUDA autocast op lists (e.g. ``pow`` and ``layer_norm`` run in fp32), the CUDA attention kernel that
``scaled_dot_product_attention`` picks (flash, memory-efficient or the math fallback that materialises the
attention matrix), and the caching allocator's 512-byte rounding. Optimizer state and step temporaries are added
by formula for the optimizer named.

The parts, from the bottom up:

- ``tracker``: the live tracker (every storage alive, op costs, replay of identical meta calls) and ``Run``;
- ``fake``: the model as meta or fake tensors, the batch as shapes, how to call the model, Hugging Face configs,
  and the kernels whose meta function refuses what the real one runs (fp32 grouped_mm: MoE experts);
- ``values``: the real values of tensors computed from constants, for a module that reads one (``.item()``);
- ``cuda``: the CUDA allocator and kernel rules (512-byte blocks, workspaces, autocast lists, fused attention);
- ``attribution``: which block runs now, and what each block saves;
- ``simulated_offload``: activation offload on tensors without data;
- ``optimizer_state``: the optimizer's bytes by formula;
- ``arguments``: the arguments checked, every problem at once;
- ``explain``: the peak and the assumptions in words;
- ``prepare``: the step's set-up: the model, its inputs, and what watches the step;
- ``step``: ``trace`` and ``estimate``: forward, backward and optimizer step, then the report.
"""

from memtrain.estimate.arguments import MAX_LAYERS, MAX_LOSS_CHUNKS, OptimizerKind, Precision
from memtrain.estimate.fake import hf_config_from_file, meta_model
from memtrain.estimate.optimizer_state import optimizer_bytes
from memtrain.estimate.step import Trace, estimate, trace
from memtrain.estimate.tracker import Run, round_up

__all__ = [
    "MAX_LAYERS",
    "MAX_LOSS_CHUNKS",
    "OptimizerKind",
    "Precision",
    "Run",
    "Trace",
    "estimate",
    "hf_config_from_file",
    "meta_model",
    "optimizer_bytes",
    "round_up",
    "trace",
]
