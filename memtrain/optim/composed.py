"""ComposedOptimizer: an optimizer class (memtrain's AdamW with a state precision, or any named class) with
step-in-backward and partial host offload, as one torch optimizer.

AdamW holds 16 bytes per fp32 parameter on the device (weights, gradient, two moments). Each option here trades
a little time or precision for some of them, and ``build_optimizer`` (``memtrain.optim.build``) combines them into
one ``torch.optim.Optimizer`` that LR schedulers, ``GradientAccumulator``, clipping, ``state_dict`` and the fp16
``GradScaler`` accept:

- ``state_precision``: the two moments in fp32 (8 bytes/param), bf16 (4: our ``BF16StateAdamW``, stochastic
  rounding, fp32 master kept) or int8 (about 2.03: bitsandbytes' block-wise 8-bit AdamW, the ``lowbit`` extra;
  tensors under 4,096 elements keep fp32 moments, as bitsandbytes and torchao do): ``memtrain.optim.moments``.
- ``step_in_backward``: each parameter steps as soon as its gradient is final and the gradient is freed at once,
  so the whole model's gradients never coexist (4 bytes/param less at the backward's peak). One backward pass:
  clipping uses the previous window's norm (lagged clipping), an fp16 overflow stops the parameters not yet
  stepped (see ``ComposedOptimizer``): ``memtrain.optim.in_backward``.
- ``offload_fraction``: that share of the parameters (the last ones in registration order, whose gradients land
  first in backward) keep their fp32 master and state in host RAM through ``CPUOffloadOptimizer``:
  ``memtrain.optim.partial``.

``optimizer_memory`` (``memtrain.optim.memory``) gives the bytes of each option without building anything (for
``estimate`` and the planner); it equals what ``memtrain.measure.optimizer_state_bytes`` counts for the built
optimizer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memtrain.errors import ConfigError, MemtrainError
from memtrain.message import arg
from memtrain.optim.in_backward import HyperparameterSync, StepInBackward, step_hook
from memtrain.optim.moments import (
    BF16StateAdamW,
    adopt_entry,
    entry_for,
    moments_of,
    precision_of,
    state_class,
)
from memtrain.optim.offload import CPUOffloadOptimizer
from memtrain.optim.partial import HostPart
from memtrain.optim.pure_bf16 import PureBF16AdamW
from memtrain.precision import step_with_inf_flag
from memtrain.techniques.optimizer import NamedOptimizer


class ComposedOptimizer(torch.optim.Optimizer):
    """An optimizer class (AdamW with a state precision, or a named one) over named parameters, with optional
    step-in-backward and partial host offload.

    Trade-off: see the module docstring; each option is off (fp32 state on the device, an ordinary step) unless
    asked for. Build it with ``build_optimizer``.

    With ``step_in_backward``, backward is where parameters step: the default arming steps every backward (a loop
    of ``loss.backward(); opt.step(); opt.zero_grad()`` works, with no clipping); ``GradientAccumulator`` arms each
    micro-batch itself (``prepare_backward``) and runs the last one through ``backward(loss)``. ``step()`` stays
    the explicit boundary: it checks that a backward stepped since the last one and reports ``last_grad_norm`` (a
    device tensor: reading it is the caller's host sync); it raises when no backward ran. The backward's end did
    the rest (the host part's step, the lagged norm), so ``step()`` changes no state.

    Step-in-backward runs one backward pass per micro-batch, with clipping and with the fp16 scaler:

    - Clipping is *lagged*: window t's gradients are multiplied by ``min(1, max_norm / (norm_{t-1} + 1e-6))``,
      the coefficient of the last finite window norm before it, since a parameter steps before the later
      gradients (and so the window's norm) exist. The first window has no previous norm and is not clipped: AdamW's
      first update is ``g / (|g| + eps)`` per element, whatever the gradient's scale, so only its moments carry the
      unclipped magnitude. ``last_grad_norm`` is the window's own norm before clipping, as ``clip_grad_norm_``
      returns it. A two-pass scheme (norm first, steps in a second backward) was exact but cost a second backward
      every step and broke torch's native chunked loss, whose backward runs once.
    - NOTE: an inf/nan gradient (fp16 overflow, or any non-finite gradient) sets a flag on the device as that
      gradient lands; fused AdamW reads it and no parameter steps after it (weights, moments, step count as they
      were), with no host sync. Parameters whose gradients landed *before* it took this step with their finite
      gradients: the compromise of stepping in one pass. The scaler then backs off as usual and the window counts
      as skipped. Inner optimizers without that flag (bf16 and int8 moments, another class) are refused with an
      fp16 scaler (``techniques.optimizer.technique.IN_BACKWARD_FP16_SCALER``).
    """

    # No inf check to read before the step (CPUOffloadOptimizer says True): under an fp16 scaler,
    # GradientAccumulator steps it through scaler.step(optimizer) and reads the skip from the scale.
    found_inf_before_step = False

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, state_precision: str, offload_mask: Sequence[bool],
                 step_in_backward: bool, grad_scaler: torch.amp.GradScaler | None, pure_bf16: bool = False,
                 named: NamedOptimizer | None = None):
        names = [n for n, _ in named_params]
        params = [p for _, p in named_params]
        self.named = named if named is not None else NamedOptimizer()
        hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        if not self.named.is_adamw:  # another class: the run's hyper-parameters it takes, then its own kwargs
            hyper = self.named.hyperparameters(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
        self._options = tuple(hyper)
        self.state_precision = state_precision
        self.steps_in_backward = step_in_backward
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self._names = {id(p): n for n, p in named_params}
        self._device_params = [p for p, h in zip(params, offload_mask, strict=True) if not h]
        host_named = [(n, p) for n, p, h in zip(names, params, offload_mask, strict=True) if h]
        device_type = params[0].device.type
        cls, impl = state_class(state_precision, device_type)
        if not self.named.is_adamw:
            cls, impl = self.named.resolve(), {}
        self.pure_bf16 = pure_bf16
        if pure_bf16:  # bf16 weights, no master: the update rounded stochastically (memtrain.optim.pure_bf16)
            cls, impl = PureBF16AdamW, {"state_precision": state_precision}
        self._adding = True
        super().__init__([{"params": params, "param_names": names, **hyper}], hyper)
        self._adding = False
        self._inner: dict[int, torch.optim.Optimizer] = {}  # id(device parameter) -> the optimizer stepping it
        if self._device_params:
            if step_in_backward:
                for p in self._device_params:
                    self._inner[id(p)] = cls([p], **hyper, **impl)
            else:
                shared = cls(self._device_params, **hyper, **impl)
                self._inner.update({id(p): shared for p in self._device_params})
            for i, p in enumerate(self._device_params):
                # The bf16 rounding noise is salted by the parameter's place: the device part's from 0, the host
                # part's after them (salt_start), as load_state_dict numbers them: no two parameters share a salt
                # (the same noise), and a fresh optimizer rounds as a loaded one.
                if isinstance(self._inner[id(p)], (BF16StateAdamW, PureBF16AdamW)):
                    self._inner[id(p)].salts[id(p)] = i
        self._host = None
        if host_named:
            host_impl = state_class(state_precision, "cpu")[1] if not pure_bf16 else {"pure_bf16": True}
            if not self.named.is_adamw:
                host_impl = {"optimizer_class": cls}
            self._host = CPUOffloadOptimizer(host_named, state_precision=state_precision,
                                             salt_start=len(self._device_params), **hyper, **host_impl)
        # With host gradients the accumulator normalises and clips through us (scale_gradients_, clip_grad_norm_),
        # and GradScaler hands its inf check to step() (as with CPUOffloadOptimizer, which exposes the same
        # attribute).
        self.manages_gradients = self._host is not None and not step_in_backward
        # Whether step() skips on a device flag (found_inf) with no host sync: every part is torch's fused AdamW.
        self.takes_skip_flag = self._host is None and not step_in_backward and all(
            getattr(o, "_step_supports_amp_scaling", False) for o in self._inner.values())
        self._step_supports_amp_scaling = self._host is not None or step_in_backward
        # Stepping in backward, a non-finite gradient stops the parameters still to step only where every device
        # part takes the inf flag (fused AdamW); bf16 or int8 moments and other classes step on.
        self.guards_non_finite = all(getattr(o, "_step_supports_amp_scaling", False) for o in self._inner.values())
        self._sync_hyperparameters = HyperparameterSync(
            self.param_groups[0], self._options,
            (*{id(o): o for o in self._inner.values()}.values(), *([self._host] if self._host is not None else [])))
        order = self.param_groups[0]["params"]
        host_slots = self._host.slots if self._host is not None else []
        self._host_part = HostPart(host=self._host, host_slots=host_slots,
                                   host_gradients=self._host.host_gradients if self._host is not None else None,
                                   device_params=self._device_params, order=order,
                                   acc=self._host.accelerator if self._host is not None else None)
        self._in_backward: StepInBackward | None = None
        self._hooks = []
        if step_in_backward:
            self._in_backward = StepInBackward(inner=self._inner, names=self._names, device_params=self._device_params,
                                               host=self._host, host_slots=host_slots, order=order,
                                               sync=self._sync_hyperparameters,
                                               scaler=self.grad_scaler)
            # The hooks hold the step-in-backward part weakly, and nothing but this optimizer holds it: a dropped
            # optimizer must not keep stepping in backward.
            part = weakref.ref(self._in_backward)
            for p in self._device_params:
                self._hooks.append(p.register_post_accumulate_grad_hook(step_hook(part)))
            weakref.finalize(self, _remove_hooks, self._hooks)
        self._link_state()

    # -- what the accumulator reads (memtrain.optim.contract) ---------------------------------------------------
    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """Step-in-backward: the last window's global norm before clipping (a device tensor; reading it is the
        caller's host sync); None before the first window or without step-in-backward."""
        return self._in_backward.last_grad_norm if self._in_backward is not None else None

    @property
    def window_found_inf(self) -> torch.Tensor | None:
        """Step-in-backward: the last window's inf/nan flag (a device tensor); None when nothing was checked."""
        return self._in_backward.window_found_inf if self._in_backward is not None else None

    def prepare_backward(self, *, last: bool = True, grad_factor: float = 1.0, max_norm: float | None = None,
                         scaler: torch.amp.GradScaler | None = None) -> None:
        """Arms the next backward (step-in-backward only).

        Args:
            last: False for a micro-batch that is not the window's last: its gradients accumulate as usual.
            grad_factor: multiplies the unscaled gradients before clipping and stepping (e.g. 1 / items): a
                number, or a 0-d tensor (never read on the host).
            max_norm: clip with the coefficient of the *previous* window's norm (lagged clipping, see the class
                docstring); this window's norm is taken as its gradients step and clips the next one.
            scaler: the fp16 GradScaler whose scale the gradients carry: each is unscaled and checked as it
                lands, and no parameter steps once an inf/nan was seen.
        """
        if self._in_backward is None:
            raise MemtrainError(f"prepare_backward() on an optimizer built with {arg('step_in_backward', False)}: "
                                "its step() does the work. To resolve this error, build it with "
                                f"{arg('step_in_backward', True)} or drop the call.")
        self._in_backward.prepare(last=last, grad_factor=grad_factor, max_norm=max_norm, scaler=scaler)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagates ``loss`` as armed: one pass, the parameters stepping as their gradients are final.

        Kept so that callers need not know the arming: it is ``loss.backward()``.
        """
        loss.backward()

    # -- host gradients (HostPart): normalise, clip, unscale; the accumulator's path with a host part ----------
    def next_backward_is_last(self) -> None:
        """The host part takes each gradient's norm as it lands in the next backward (the window's last), so that
        ``clip_grad_norm_`` reads no host gradient (see ``CPUOffloadOptimizer.next_backward_is_last``)."""
        if self._host is not None:
            self._host.next_backward_is_last()

    @torch.no_grad()
    def scale_gradients_(self, factor: float | torch.Tensor) -> None:
        """Multiplies this step's gradients by ``factor`` (a number, or a one-element host tensor: not read): the
        device ones in place, the host ones lazily (the host step applies it, see
        ``CPUOffloadOptimizer.scale_gradients_``)."""
        self._check_not_in_backward("scale_gradients_")
        self._gather()
        self._host_part.scale(factor)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients (device and host) by their global norm, as ``torch.nn.utils.clip_grad_norm_``
        would if all of them were on the device; returns the norm before clipping (a CPU tensor). The host
        gradients are not read: their norms were taken as they landed, and the coefficient joins the host step's
        multiplier."""
        self._check_not_in_backward("clip_grad_norm_")
        self._gather()
        return self._host_part.clip(max_norm, norm_type)

    def _gather(self) -> None:
        self._host_part.gather(self.grad_scaler if not self.steps_in_backward else None, id(self))

    def _check_not_in_backward(self, what: str) -> None:
        if self.steps_in_backward:
            raise MemtrainError(
                f"{what} on a step-in-backward optimizer: the device parameters stepped during backward, so there "
                "is no gradient left to change. To resolve this error, pass the normalisation and the clipping "
                "before backward: GradientAccumulator(..., max_grad_norm=...) does it, or call "
                "optimizer.prepare_backward(grad_factor=..., max_norm=...) and optimizer.backward(loss).")

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_adding", False):
            raise MemtrainError("ComposedOptimizer.add_param_group: the inner optimizers are built once. To resolve this "
                                "error, pass every parameter to build_optimizer.")
        super().add_param_group(param_group)

    def _link_state(self) -> None:
        # optimizer.state[p] is the inner optimizers' own dict, so measure.optimizer_state_bytes and tools that
        # inspect optimizer.state see every byte (device and host).
        self.state.clear()
        for p in self._device_params:
            self.state[p] = self._inner[id(p)].state[p]
        if self._host is not None:
            for slot in self._host.slots:
                self.state[slot.device] = self._host.state[slot.device]

    # -- the step -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Steps what backward did not: the whole optimizer, or (step-in-backward) the host part; then the
        scaler's inf check is handed back (skipped steps change nothing)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_backward is not None:
            scaler = self._in_backward.arming.scaler  # the window's, before the boundary re-arms
            self._in_backward.end_step(self.grad_scaler)
            found = self._in_backward.found_inf
        else:
            scaler = self.grad_scaler
            found = self._step_ordinary()
        if found is not None and scaler is not None:
            # NOTE: GradScaler has no public way to receive an inf check made elsewhere: scaler.update() reads it.
            scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {found.device: found}
        self._host_part.gathered = False
        return loss

    def _step_ordinary(self) -> torch.Tensor | None:
        """Steps every part; returns the fp16 inf check handed to the scaler (None: none made here)."""
        self._sync_hyperparameters()
        if self._host is None:  # a plain optimizer: GradScaler.step() unscaled and checked the gradients
            flag = getattr(self, "found_inf", None)  # set by GradientAccumulator (or GradScaler): skip on it
            for inner in {id(o): o for o in self._inner.values()}.values():
                takes = getattr(inner, "_step_supports_amp_scaling", False)
                step_with_inf_flag(inner, flag if takes else None, getattr(self, "grad_scale", None))
            return None
        self._gather()
        found = None
        if self._host_part.device_found is not None:
            # fp16: the device gradients' inf check and the host ones' (their norm's), for the scaler and the skip.
            found = self._host_part.device_found.to("cpu") + self._host.found_inf_flag
            if found.item() > 0:
                return found  # fp16 overflow: skipped, weights and state untouched
        for inner in {id(o): o for o in self._inner.values()}.values():
            inner.step()
        if self._host is not None:
            self._host.step()
        return found

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # the device gradients
        if self._host is not None:
            self._host.zero_grad(set_to_none=set_to_none)
        self._host_part.gathered = False
        if self._in_backward is not None:
            self._in_backward.discard_window(self.grad_scaler)

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state keyed by parameter name, each entry in its precision's own format (torch's AdamW keys for
        fp32 and bf16, bitsandbytes' for int8; ``master_weight`` for offloaded non-fp32 weights), plus
        ``state_precision``. ``load_state_dict`` of any precision converts it."""
        host_sd = self._host.state_dict() if self._host is not None else {"state": {}}
        state: dict[str, dict[str, Any]] = {}
        for p in self._device_params:
            entry = self.state.get(p)
            if entry:
                state[self._names[id(p)]] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                             for k, v in entry.items()}
        state.update(host_sd["state"])
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(group["param_names"])
        out = {"state": state, "param_groups": [group], "state_precision": self.state_precision}
        if not self.named.is_adamw:
            out["optimizer"] = self.named.path
        if self._in_backward is not None:
            out["lagged_grad_norm"] = float(self._in_backward.lagged_norm)  # clips the next window: a resumed run clips alike
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state saved by this class (any state precision), by CPUOffloadOptimizer or by a plain AdamW with
        named parameters: entries are matched by name and converted to this optimizer's precision (fp32 <-> bf16
        casts, int8 dequantised or requantised block-wise). Load the model's weights first.

        Raises:
            ConfigError: unknown names, shape mismatches, or entries that are not AdamW state.
        """
        if not self.named.is_adamw:
            self._load_own_state(state_dict)
            return
        saved_groups = state_dict["param_groups"]
        saved_names = [n for g in saved_groups for n in g.get("param_names", g["params"])]
        keys = [k for g in saved_groups for k in g["params"]]
        by_key = dict(zip(keys, saved_names, strict=True))
        params = {n: p for n, p in zip(self.param_groups[0]["param_names"], self.param_groups[0]["params"],
                                       strict=True)}
        problems = []
        converted: dict[str, tuple[float, torch.Tensor, torch.Tensor]] = {}
        same: dict[str, dict[str, Any]] = {}  # entries already in this precision: loaded as they are
        masters: dict[str, torch.Tensor] = {}
        for key, entry in state_dict["state"].items():
            name = by_key.get(key, key)
            p = params.get(name)
            if p is None:
                problems.append(f"state entry {name!r} names no parameter of this optimizer.")
                continue
            try:
                step, m, v = moments_of(entry)
            except ConfigError as e:
                problems.append(f"{name!r}: {e}")
                continue
            if m.numel() != p.numel():
                problems.append(f"state of {name!r} holds {m.numel()} elements, the parameter {p.numel()}.")
                continue
            converted[name] = (step, m, v)
            if precision_of(entry) == self.state_precision:
                same[name] = entry
            if "master_weight" in entry:
                masters[name] = entry["master_weight"]
        if problems:
            problems[-1] += " To resolve this error, load a state_dict saved for the same model (named parameters)."
        ConfigError.raise_if(problems)
        # Every key of the saved group, as torch's optimizers keep them (a scheduler's initial_lr among them:
        # StepLR(..., last_epoch=k) after loading needs it); the parameters stay this optimizer's own.
        self.param_groups[0].update({k: v for k, v in saved_groups[0].items() if k not in ("params", "param_names")})
        self._sync_hyperparameters()
        self._load_lagged_norm(state_dict)
        for i, p in enumerate(self._device_params):
            inner = self._inner[id(p)]
            inner.state.pop(p, None)
            name = self._names[id(p)]
            if name in same:
                inner.state[p] = adopt_entry(inner, p, same[name])
            elif name in converted:
                inner.state[p] = entry_for(inner, p, converted[name], salt=i)
        if self._host is not None:
            host = {slot.key for slot in self._host.slots}
            self._host.load_entries({n: e for n, e in same.items() if n in host},
                                    {n: m for n, m in converted.items() if n in host},
                                    {n: w for n, w in masters.items() if n in host})
        self._link_state()

    def _load_own_state(self, state_dict: dict[str, Any]) -> None:
        """Another class's state, saved by this class: each entry loaded as it is (by parameter name), onto the
        device part's parameters and into the host part.

        Raises:
            ConfigError: a state saved for another optimizer, or names this optimizer does not have.
        """
        saved = state_dict.get("optimizer", "adamw")
        if saved != self.named.path:
            raise ConfigError(f"the state_dict is {saved!r}'s state, this optimizer {self.named.path!r}'s. To resolve "
                              "this error, build the optimizer the state was saved with.")
        group = state_dict["param_groups"][0]
        by_key = dict(zip(group["params"], group.get("param_names", group["params"]), strict=True))
        entries = {by_key.get(k, k): v for k, v in state_dict["state"].items()}
        device = {self._names[id(p)]: p for p in self._device_params}
        host = {slot.key for slot in self._host.slots} if self._host is not None else set()
        unknown = sorted(set(entries) - set(device) - host)
        if unknown:
            raise ConfigError(f"state entries {unknown[:5]} name no parameter of this optimizer. To resolve this "
                              "error, load a state_dict saved for the same model (named parameters).")
        self.param_groups[0].update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        self._sync_hyperparameters()
        self._load_lagged_norm(state_dict)
        problems = [self._entry_problem(name, p, entries[name]) for name, p in device.items() if name in entries]
        ConfigError.raise_if(p for p in problems if p)
        for name, p in device.items():
            inner = self._inner[id(p)]
            inner.state.pop(p, None)
            if name in entries:
                # torch's placement: the step counter stays on the CPU unless the class is fused or capturable.
                on_device = inner.defaults.get("fused") or inner.defaults.get("capturable")
                inner.state[p] = {k: v.detach().to(p.device if k != "step" or on_device else "cpu", copy=True)
                                  if isinstance(v, torch.Tensor) else v for k, v in entries[name].items()}
        if self._host is not None:
            names = [slot.key for slot in self._host.slots]
            self._host.load_state_dict({
                "state": {n: entries[n] for n in names if n in entries},
                "param_groups": [{**{k: v for k, v in self._host.param_groups[0].items() if k != "params"},
                                  "params": names, "param_names": names}]})
        self._link_state()

    def _load_lagged_norm(self, state_dict: dict[str, Any]) -> None:
        if self._in_backward is not None:  # clips the next window: a resumed run clips alike
            self._in_backward.lagged_norm = torch.tensor(float(state_dict.get("lagged_grad_norm", 0.0)))

    def _entry_problem(self, name: str, p: torch.Tensor, entry: dict[str, Any]) -> str | None:
        """A saved entry that is not this class's state of a parameter of ``p``'s shape (its bytes against the
        probe's), in words naming the fix; None when it fits."""
        saved = sum(v.numel() * v.element_size() for v in entry.values() if isinstance(v, torch.Tensor))
        expected = self.named.state_bytes(tuple(p.shape), p.dtype)
        if saved == expected:
            return None
        return (f"state of {name!r} holds {saved:,} bytes; {self.named.text}'s state of a {tuple(p.shape)} parameter "
                f"holds {expected:,}. To resolve this error, load a state_dict saved for the same model.")

    def close(self) -> None:
        """Removes the hooks (step-in-backward) and stops the host part's worker."""
        _remove_hooks(self._hooks)
        if self._host is not None:
            self._host.close()


def _remove_hooks(hooks: list[Any]) -> None:
    for handle in hooks:
        handle.remove()
    hooks.clear()

