"""The Hugging Face Trainer with memtrain's memory techniques: ``prepare_model`` applies those that change the model
(each technique's ``prepare_model``: the checkpointing policy, the chunked loss), ``MemtrainTrainer`` (built by
``build_trainer_class``) those that act on the step (each one's ``trainer_step``: activation offload) and the
offloaded optimizer (the optimizer technique's ``trainer_host_optimizer``); what the Trainer is given open, each
technique's ``trainer_default`` fills in. Both are imported from ``memtrain.hf``, whose docstring shows the recipe.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain.choices import Choices
from memtrain.errors import ConfigError
from memtrain.loss import chunk_tokens_of, supports_chunked_loss
from memtrain.message import arg
from memtrain.optim import CPUOffloadOptimizer
from memtrain.techniques import REGISTRY, Terms
from memtrain.techniques import optimizer as optimizer_technique
from memtrain.techniques import problems as rule_problems
from memtrain.tiled_mlp import supports_tiled_mlp
from memtrain.unwrap import unwrap_model


def trainer_choices(choices: Choices) -> Choices:
    """``choices`` with what it leaves open (None) as each technique's ``trainer_default`` fills it in: there is no
    planner here, so an open checkpointing policy is "all" and an open chunked loss is on; ``checkpointing="none"``
    and ``chunked_loss=False`` turn them off."""
    return dataclasses.replace(choices, **{name: value for technique in REGISTRY
                                           for name, value in technique.trainer_default(choices).items()})


# What MemtrainTrainer does when not told: every decoder layer recomputed in backward, the loss's fp32 logits
# chunk_tokens at a time (the rest off: the Trainer's own AdamW on the device, activations on the device).
HF_DEFAULT_CHOICES = trainer_choices(Choices())


def trainer_problems(choices: Any) -> list[str]:
    """What ``prepare_model`` / ``MemtrainTrainer`` cannot do of ``choices``, in words naming the fix."""
    if not isinstance(choices, Choices):
        return [f"memory={choices!r} must be a memtrain.choices.Choices. To resolve this error, pass e.g. "
                "memory=Choices(checkpointing='all', chunked_loss=True), or Choices.from_dict(...) of a mapping."]
    return [text for technique in REGISTRY for text in technique.trainer_problems(choices)]


# The chunked-loss rule in the Trainer helper's words: its default choices chunk the loss, so the fix is to say not to.
TRAINER_TERMS = Terms(fixes={"chunked-loss-model": "pass Choices(chunked_loss=False) (the default choices, "
                                                  "HF_DEFAULT_CHOICES, chunk the loss)",
                             "tiled-mlp-model": "pass Choices(tiled_mlp=False) (or leave it unset)"})


def _chunked_loss_problems(model: Any, choices: Any) -> list[str]:
    """The rules with what ``model`` is (a loss memtrain.loss cannot chunk, an MLP memtrain.tiled_mlp cannot tile)
    for ``choices`` as the Trainer helper fills them in (``trainer_choices``: an open chunked loss is on), checked
    before anything of the model changes."""
    if not isinstance(choices, Choices) or not isinstance(model, nn.Module):
        return []
    inner = unwrap_model(model)
    return rule_problems(trainer_choices(choices).setup(
        chunkable=supports_chunked_loss(inner), tileable=supports_tiled_mlp(inner)),
        TRAINER_TERMS)


def _trainer_model_problems(model: Any) -> list[str]:
    """What MemtrainTrainer cannot train of ``model``: weights on the meta device (shapes with no values)."""
    if not isinstance(model, nn.Module):
        return []  # the Trainer names a missing or wrong model itself
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if not meta:
        return []
    return [f"MemtrainTrainer: {len(meta)} of the model's weights are on the meta device (e.g. {meta[0]}): they "
            "have shapes but no values, so there is nothing to train (a model built under torch.device('meta') is "
            "for memtrain.estimate and memtrain.plan). To resolve this error, load the weights "
            "(memtrain.hf.load_pretrained(DIR)), or build the model on a real device "
            "(AutoModelForCausalLM.from_config(config) outside torch.device('meta'))."]


@dataclass(frozen=True)
class Prepared:
    """What ``prepare_model`` applied, with a reason per technique."""

    checkpointed: tuple[str, ...]
    chunk_tokens: int | None
    reasons: tuple[str, ...]


def prepare_model(model: nn.Module, choices: Choices = HF_DEFAULT_CHOICES, *, chunk_tokens: int = 1024) -> Prepared:
    """Applies ``choices``' checkpointing policy and chunked loss (``chunk_tokens`` tokens of logits at a time) to a
    Hugging Face causal LM (a LoRA one too), in place, and turns its KV cache off (a cache holds every layer's keys
    and values: for generation, not training). What ``choices`` leaves open is ``HF_DEFAULT_CHOICES``'s
    (``trainer_choices``): every layer checkpointed, the loss chunked. The optimizer placement and
    ``offload_activations`` are ``MemtrainTrainer``'s to apply (they act on the training step, not the model).

    Raises:
        ConfigError: ``choices`` not a ``Choices``, or holding what the Trainer helper cannot do (each technique's
            ``trainer_problems``, in its module); a model whose loss ``memtrain.loss`` cannot chunk, with
            ``chunked_loss=True``. Every problem at once.
    """
    ConfigError.raise_if(trainer_problems(choices) + _chunked_loss_problems(model, choices))
    choices = trainer_choices(choices)
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    reasons: list[str] = []
    checkpointed: tuple[str, ...] = ()
    for technique in REGISTRY:  # in the registry's order: the policy wraps the blocks before the loss is chunked
        part = technique.prepare_model(inner, choices, chunk_tokens=chunk_tokens)
        reasons += part.pop("reasons", [])
        checkpointed = part.pop("checkpointed", checkpointed)
        assert not part, f"{technique}: Prepared has no {sorted(part)}"
    return Prepared(checkpointed, chunk_tokens_of(inner), tuple(reasons))


def _inner_optimizer(optimizer: Any) -> Any:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` wrappers."""
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _refuse_fp16_with_offload(args: Any, offloaded: bool) -> None:
    """ConfigError for fp16 (a GradScaler) with the optimizer ``offloaded``: its gradients are on the host."""
    if offloaded and (args.fp16 or getattr(args, "half_precision_backend", None) == "apex"):
        raise ConfigError("MemtrainTrainer: fp16=True with CPUOffloadOptimizer: the Trainer's GradScaler "
                          "would unscale gradients that are already on the host. To resolve this error, "
                          "pass bf16=True (no scaler needed), or keep the optimizer on the device (drop "
                          f"{arg('optimizer.placement', 'offload')}).")


def _clip_through_the_optimizer(trainer: Any) -> None:
    """Routes ``trainer``'s clipping (and its logged gradient norm) to ``CPUOffloadOptimizer.clip_grad_norm_``
    when its optimizer is one: its gradients are on the host, where the accelerator's clip would find none."""
    clip = trainer.accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        # NOTE: every Trainer version clips (and takes the logged norm) through this one call.
        inner = _inner_optimizer(trainer.optimizer)
        if isinstance(inner, CPUOffloadOptimizer):
            return inner.clip_grad_norm_(max_norm, norm_type)
        return clip(parameters, max_norm, norm_type=norm_type)

    trainer.accelerator.clip_grad_norm_ = clip_grad_norm_


def _offloaded_optimizer(trainer: Any, model: nn.Module, host: tuple[Any, dict[str, Any]]) -> torch.optim.Optimizer:
    """``CPUOffloadOptimizer`` over ``host`` (the optimizer technique's ``trainer_host_optimizer``: AdamW, or the
    class the run names, with what it takes of the choices) with ``trainer``'s hyperparameters and its two groups
    (weight decay on the parameters the Trainer decays, none on the others)."""
    decay = set(trainer.get_decay_parameter_names(model))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if n in decay], "weight_decay": trainer.args.weight_decay},
              {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    named, options = host
    if not named.is_adamw:  # the run's class: the Trainer's learning rate, the groups' weight decay, its own kwargs
        hyper = named.hyperparameters(lr=trainer.args.learning_rate, weight_decay=trainer.args.weight_decay,
                                      betas=(trainer.args.adam_beta1, trainer.args.adam_beta2),
                                      eps=trainer.args.adam_epsilon)
        return CPUOffloadOptimizer(groups, named.resolve(), **hyper, **options)
    return CPUOffloadOptimizer(groups, torch.optim.AdamW, lr=trainer.args.learning_rate, **options,
                               betas=(trainer.args.adam_beta1, trainer.args.adam_beta2), eps=trainer.args.adam_epsilon)


def build_trainer_class(transformers: Any) -> type:
    """``MemtrainTrainer``, a subclass of ``transformers.Trainer`` (``transformers``: the module), built on first
    use by ``memtrain.hf`` so that importing memtrain needs no transformers."""
    class _ZeroHostGradients(transformers.TrainerCallback):
        # The Trainer ends a step with model.zero_grad(), which clears only device gradients: the host buffers
        # CPUOffloadOptimizer accumulates into would carry this step's sum into the next.
        def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            inner = _inner_optimizer(optimizer)
            if isinstance(inner, CPUOffloadOptimizer):
                inner.zero_grad(set_to_none=True)

    class MemtrainTrainer(transformers.Trainer):
        """``transformers.Trainer`` with memtrain's memory savings: ``memory``, a ``memtrain.choices.Choices`` (by
        default ``HF_DEFAULT_CHOICES``: every layer checkpointed, the loss chunked; what it leaves open is taken from
        there), applied by ``prepare_model`` (checkpointing policy, chunked loss of ``chunk_tokens``) and here
        (optimizer placement, activation offload). What the Trainer cannot do (each technique's
        ``trainer_problems``: ``optimizer.state_precision`` on the device, since lean moments need placement
        "offload"; ``step_in_backward``, ``offload_fraction``, ``compile``, ``pure_bf16``, ``offload_weights``),
        what contradicts the TrainingArguments (``trainer_arguments_problems``: their own gradient checkpointing
        with a policy), and a model on the meta device, is one ConfigError naming the fix.

        Differences from the plain Trainer, each needed for correctness:

        - With ``CPUOffloadOptimizer`` (``memory.optimizer.placement="offload"``, or one passed in ``optimizers=``)
          gradients leave the device as backward produces them, so the Trainer's
          ``accelerator.clip_grad_norm_(model.parameters(), ...)`` would find none: clipping and the logged
          gradient norm go through ``CPUOffloadOptimizer.clip_grad_norm_`` instead; its host gradients are reset
          after each optimizer step; fp16 (a GradScaler on host gradients) is refused: use ``bf16=True``.
        - ``memory.offload_activations`` wraps each training step's forward and backward in
          ``memtrain.offload_activations(model=...)``.

        Example:
            >>> trainer = MemtrainTrainer(model=model, args=TrainingArguments("out", max_steps=10),  # doctest: +SKIP
            ...                           train_dataset=rows, data_collator=hf_collate,
            ...                           memory=Choices(checkpointing="all", chunked_loss=True,
            ...                                          optimizer=OptimizerChoice(placement="offload")))
            >>> trainer.train()  # doctest: +SKIP
        """

        def __init__(self, model: nn.Module, args: Any = None, *, memory: Choices = HF_DEFAULT_CHOICES,
                     chunk_tokens: int = 1024, **trainer_kwargs: Any):
            ConfigError.raise_if(trainer_problems(memory) + _trainer_model_problems(model)
                                 + _chunked_loss_problems(model, memory))
            memory = trainer_choices(memory)
            ConfigError.raise_if([text for technique in REGISTRY
                                  for text in technique.trainer_arguments_problems(memory, args)])
            self.memory = memory
            self.prepared = prepare_model(model, memory, chunk_tokens=chunk_tokens)
            super().__init__(model=model, args=args, **trainer_kwargs)
            self._host_optimizer = optimizer_technique.TECHNIQUE.trainer_host_optimizer(memory)
            _refuse_fp16_with_offload(self.args, self._host_optimizer is not None
                                      or isinstance(_inner_optimizer(self.optimizer), CPUOffloadOptimizer))
            # What each step runs inside (activation offload's offloader), built once: pool and order persist.
            steps = (technique.trainer_step(unwrap_model(model), memory) for technique in REGISTRY)
            self._step_contexts = [context for context in steps if context is not None]
            self.add_callback(_ZeroHostGradients())
            _clip_through_the_optimizer(self)

        def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
            if self.optimizer is not None or self._host_optimizer is None:
                return super().create_optimizer(*([] if model is None else [model]))
            self.optimizer = _offloaded_optimizer(self, self.model if model is None else model, self._host_optimizer)
            return self.optimizer

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            with ExitStack() as stack:
                for context in self._step_contexts:
                    stack.enter_context(context)
                return super().training_step(*args, **kwargs)

    return MemtrainTrainer
