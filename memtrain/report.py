"""Frozen results: ``MemoryReport`` (what a step holds, in bytes) and the one byte-formatting helper.

Bytes are integers everywhere inside memtrain; GiB appear only at the edges, through ``format_bytes`` and
``parse_bytes``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from memtrain.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def format_bytes(n: int | None) -> str:
    """Formats a byte count for people: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def parse_bytes(text: str) -> int:
    """Parses a size such as ``24GiB``, ``1.5 GB`` or ``4096`` into bytes (GiB = 2**30, GB = 10**9).

    Raises:
        ConfigError: the text is not a size.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{text!r} is not a size. To resolve this error, write a number with a unit, e.g. 24GiB, 512MiB or 8GB."
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive. To resolve this error, pass e.g. 24GiB.")
    return int(value)


Source = Literal["measured", "estimated"]


@dataclass(frozen=True)
class MemoryReport:
    """What one training step holds, per category, in bytes.

    ``activation_bytes`` counts the tensors autograd saved for backward, each storage once (views and tensors
    saved twice count once); parameters and buffers that ops save are model state, not activations.
    ``peak_bytes`` is the device allocator's peak (CUDA) or a prediction (``source == "estimated"``); it is
    ``None`` where nothing can measure it (a CPU run). ``reserved_bytes`` is the allocator's peak reserved (what
    it held from the driver: the peak plus its segments' free room), measured or, for an estimate on CUDA,
    predicted by the caching allocator's rules (``memtrain.device.segments``); ``None`` elsewhere.
    ``needed_bytes`` is the device memory the step runs in by those rules (segments given back where an
    allocation fails; ``SegmentModel.least_capacity``, which says how close to the least it is): what a budget must
    hold; predicted on CUDA, ``None`` elsewhere.
    """

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    activation_tensors: int = 0
    device: str = "cpu"
    source: Source = "measured"
    peak_bytes: int | None = None
    peak_phase: str | None = None
    phase_bytes: tuple[tuple[str, int], ...] = ()
    host_bytes: int = 0
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    reserved_bytes: int | None = None
    needed_bytes: int | None = None

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def total_bytes(self) -> int:
        """Model state + saved activations: a lower bound on the peak (temporaries come on top)."""
        return self.model_state_bytes + self.activation_bytes

    def replace(self, **changes: Any) -> MemoryReport:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["phase_bytes"] = dict(self.phase_bytes)
        out["assumptions"] = list(self.assumptions)
        out["model_state_bytes"] = self.model_state_bytes
        out["total_bytes"] = self.total_bytes
        return out

    def summary(self) -> str:
        """A table of the breakdown, returned (not printed)."""
        rows = [
            ("parameters", self.parameter_bytes),
            ("gradients", self.gradient_bytes),
            ("optimizer state", self.optimizer_state_bytes),
            (f"activations ({self.activation_tensors} tensors)", self.activation_bytes),
            ("total (model state + activations)", self.total_bytes),
        ]
        if self.peak_bytes is not None:
            rows.append((f"{self.device} peak", self.peak_bytes))
        if self.reserved_bytes is not None:
            rows.append((f"{self.device} peak reserved", self.reserved_bytes))
        if self.needed_bytes is not None:
            rows.append((f"{self.device} least memory it runs in", self.needed_bytes))
        rows += [(f"allocated after {phase}", n) for phase, n in self.phase_bytes]
        if self.host_bytes:
            rows.append(("host (CPU) memory", self.host_bytes))
        width = max(len(name) for name, _ in rows)
        lines = [f"memory report ({self.source}, {self.device})"]
        lines += [f"  {name:<{width}}  {format_bytes(n):>12}" for name, n in rows]
        if self.peak_phase:
            lines.append(f"  peak at: {self.peak_phase}")
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)


# -- pictures of a run (matplotlib, imported only when drawing) ----------------------------------------------
CATEGORIES = (("parameter_bytes", "parameters"), ("gradient_bytes", "gradients"),
              ("optimizer_state_bytes", "optimizer state"), ("activation_bytes", "activations"))


def save_figure(fig: Any, path: str) -> None:
    from memtrain.files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))


def plot_loss(path: str, metrics: list[dict[str, Any]]) -> None:
    """loss.png: training loss per optimizer step, and the held-out loss where it was evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="training loss", linewidth=1)
    evals = [m for m in metrics if m.get("eval_loss") is not None]
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)
    plt.close(fig)


def memory_bars(ax: Any, breakdowns: dict[str, dict[str, int]]) -> None:
    """Draws on ``ax`` the per-category bytes of each breakdown (e.g. without and with memtrain), side by side."""
    width = 0.8 / max(1, len(breakdowns))
    for i, (label, breakdown) in enumerate(breakdowns.items()):
        values = [(breakdown.get(key) or 0) / 2**20 for key, _ in CATEGORIES]  # None: not measured
        bars = ax.bar([c + i * width for c in range(len(CATEGORIES))], values, width, label=label)
        # Upright labels: side by side, horizontal ones wider than their bar run into each other.
        ax.bar_label(bars, labels=[format_bytes(breakdown.get(key)) for key, _ in CATEGORIES], fontsize=7,
                     rotation=90, padding=2)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room above the tallest bar for its upright label
    # Two-word categories on two lines: one line each, neighbours overlap ("optimizer stateactivations").
    ax.set_xticks([c + width * (len(breakdowns) - 1) / 2 for c in range(len(CATEGORIES))],
                  [name.replace(" ", "\n") for _, name in CATEGORIES])
    ax.set_ylabel("MiB")
    ax.set_title("memory of one training step")
    ax.legend(loc="upper left", fontsize=8)
