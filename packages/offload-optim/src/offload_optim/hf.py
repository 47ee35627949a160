"""Training with the Hugging Face ``Trainer``: :class:`OffloadTrainer`.

Needs ``transformers`` (and ``accelerate``, which its ``Trainer`` needs, and
``safetensors``, which checkpoints are read with): the ``hf`` extra,
``pip install 'offload-optim[hf]'``. Not imported by ``offload_optim`` itself.

How it fits the ``Trainer`` (a subclass; only what offload changes is overridden):

- The ``Trainer`` is given a parameterless stand-in module (:class:`OffloadShell`), so that
  neither it nor ``accelerate`` moves, wraps or counts the original model; the accelerator
  does no device placement (its optimizer wrapper would otherwise copy the optimizer state
  to the device and back), and ``_prepare_inputs`` moves each batch to ``args.device``.
- :meth:`OffloadTrainer.create_optimizer` plans and builds the :class:`OffloadModule` with
  ``memory_optimize`` from the first training batch's shapes, then returns an
  :class:`AMPOptimizer` over a :class:`HybridAdam` with the ``Trainer``'s AdamW settings
  (``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay`` on the
  parameters ``get_decay_parameter_names`` names, as the ``Trainer``'s own AdamW does) and
  ``max_grad_norm`` as its clipping norm. The ``Trainer``'s scheduler edits its
  ``param_groups`` (the HybridAdam's), so any ``lr_scheduler_type`` drives the lr.
- :meth:`OffloadTrainer.training_step` runs the module, divides the loss by the
  accumulation window's length as the ``Trainer`` does, and backpropagates through
  :meth:`AMPOptimizer.backward` (fp16 loss scaling); the ``Trainer``'s ``optimizer.step()``
  and ``model.zero_grad()`` reach :meth:`AMPOptimizer.step` and ``zero_grad``.
- :meth:`OffloadTrainer.save_model` saves the fp32 master weights under the original
  model's state-dict names (``save_pretrained`` for a ``PreTrainedModel``).
- Checkpoints: a ``checkpoint-N`` folder holds the masters as ``save_model`` writes them,
  ``optimizer.pt`` with :meth:`AMPOptimizer.state_dict` but the masters (moments, step
  counts, loss scaler), and the ``Trainer``'s scheduler, RNG and trainer state. Resuming
  checks the files in :meth:`OffloadTrainer._load_from_checkpoint` (called before the
  module exists) and restores masters and optimizer state in
  :meth:`OffloadTrainer._load_optimizer_and_scheduler`, which the ``Trainer`` calls once
  ``create_optimizer`` has built the module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from offload_optim.amp import AMPOptimizer
from offload_optim.hybrid_adam import HybridAdam
from offload_runtime import OffloadConfig, memory_optimize
from offload_runtime.module import OffloadModule

try:
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME
except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
    raise ImportError(
        "offload_optim.hf needs transformers, accelerate and safetensors: install the 'hf' "
        "extra, pip install 'offload-optim[hf]'"
    ) from exc

__all__ = ["OffloadShell", "OffloadTrainer", "causal_lm_loss"]

FIXED_SHAPES = (
    "the OffloadModule is planned for the first batch's shapes, so every batch must have "
    "them: pad to a fixed length (e.g. DataCollatorWithPadding(tokenizer, "
    "padding='max_length', max_length=...)) or use a fixed-length dataset, and set "
    "TrainingArguments(dataloader_drop_last=True) so that the last batch is full"
)


def causal_lm_loss(output: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The loss of a causal LM's ``output`` for the batch ``inputs``: the model's own
    ``loss`` when it returned one, else the next-token cross-entropy of its logits (the
    ``logits`` entry, the first element, or the tensor itself) against ``labels`` (or
    ``input_ids`` without labels), shifted by one, -100 ignored, in fp32."""
    if isinstance(output, Mapping) and output.get("loss") is not None:
        return output["loss"]  # type: ignore[no-any-return]
    if isinstance(output, Mapping):
        logits = output["logits"]
    elif isinstance(output, tuple | list):
        logits = output[0]
    else:
        logits = output
    labels = inputs.get("labels", inputs.get("input_ids"))
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(
            "causal_lm_loss needs logits (a tensor, or a mapping or tuple holding them) and "
            "labels or input_ids in the batch; override OffloadTrainer.compute_loss for "
            "other models"
        )
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(
        shifted, labels[:, 1:].reshape(-1).to(shifted.device), ignore_index=-100
    )


class OffloadShell(torch.nn.Module):
    """What the ``Trainer`` sees as its model: no parameters or buffers of its own, the
    original model's ``forward`` signature (so ``remove_unused_columns`` keeps its
    inputs) and ``config``; calls go to the :class:`OffloadModule` once it is built, with
    the batch's tensors but ``labels``."""

    accepts_loss_kwargs = False
    """The ``Trainer`` passes no ``num_items_in_batch``: the loss is a per-batch mean."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        # Not registered as a submodule: .to(), .parameters() and state_dict() skip it.
        object.__setattr__(self, "original", model)
        self.config = getattr(model, "config", None)
        self.offload: OffloadModule | None = None
        self.amp: AMPOptimizer | None = None
        # The Trainer reads the forward's signature for the dataset columns to keep.
        ref = weakref.ref(self)

        @functools.wraps(model.forward)
        def forward(**inputs: Any) -> Any:
            shell = ref()
            assert shell is not None
            return shell._run(**inputs)

        object.__setattr__(self, "forward", forward)

    original: torch.nn.Module

    def _run(self, **inputs: Any) -> Any:
        if self.offload is None:
            raise RuntimeError(
                "the OffloadModule is built from the first training batch by "
                "OffloadTrainer.create_optimizer (train() calls it); nothing to run yet"
            )
        return self.offload(**model_inputs(inputs))

    def train(self, mode: bool = True) -> OffloadShell:
        super().train(mode)
        if self.offload is not None:
            self.offload.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The ``Trainer`` zeroes the model's gradients after each step: the optimizer's."""
        if self.amp is not None:
            self.amp.zero_grad(set_to_none)


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch entries the traced model takes: every one but ``labels`` (the loss is
    computed outside the traced graph)."""
    return {k: v for k, v in batch.items() if k != "labels"}


def _shapes(batch: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def _weights_file(folder: Path) -> Path:
    """The file :meth:`OffloadTrainer.save_model` wrote the weights to in ``folder``:
    ``model.safetensors``, its sharded index, or ``pytorch_model.bin``."""
    for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(
        f"{folder} holds no model weights ({SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME} "
        f"or {WEIGHTS_NAME}, as OffloadTrainer.save_model writes them): not a checkpoint "
        "of an OffloadTrainer"
    )


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the weights file ``path`` (see :func:`_weights_file`), on the CPU."""
    if path.name == SAFE_WEIGHTS_INDEX_NAME:
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(path.parent / shard), device="cpu"))
        return tensors
    if path.name == SAFE_WEIGHTS_NAME:
        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def _check_weights(
    path: Path,
    weights: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    module: OffloadModule,
) -> None:
    """Refuse ``weights`` (read from ``path``) unless they fit ``module`` (built from
    ``model``): only ``model``'s state-dict names, with its shapes, and every parameter
    under one of its tied names (``save_pretrained`` writes one name of a tied group)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    unknown = sorted(set(weights) - set(shapes))
    wrong = [
        f"{name} {tuple(t.shape)} (the model's {shapes[name]})"
        for name, t in weights.items()
        if name in shapes and tuple(t.shape) != shapes[name]
    ]
    missing = [
        layout.name
        for st in module.storages
        for layout in st.layouts
        if not any(alias in weights for alias in layout.aliases)
    ]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} names the model lacks, e.g. {unknown[:3]}")
    if wrong:
        problems.append(f"{len(wrong)} tensors of other shapes, e.g. {wrong[:3]}")
    if missing:
        problems.append(f"{len(missing)} of the model's parameters missing, e.g. {missing[:3]}")
    if problems:
        raise ValueError(
            f"{path} is not a checkpoint of this model: {'; '.join(problems)}. Resume with "
            "the model the checkpoint was trained from"
        )


class OffloadTrainer(Trainer):
    """A ``transformers.Trainer`` that trains ``model`` under ``memory_budget`` bytes of
    device memory through ``memory_optimize``, ``HybridAdam`` and ``AMPOptimizer``.

    Args:
        model: the model (real weights, on the CPU is best: it is traced, not moved).
        args: the ``TrainingArguments``; ``optim`` is ignored (always AdamW through
            ``HybridAdam``), ``fp16``/``bf16`` are refused (the training dtype is
            ``offload_config.dtype``), and ``gradient_accumulation_steps`` sets the
            config's ``accumulation_steps``.
        memory_budget: the device memory budget in bytes (``memory_optimize``'s).
        offload_config: the :class:`OffloadConfig` (default: its defaults, fp16 training).
        solver: ``"asyn"`` or ``"syn"``.
        **kwargs: the ``Trainer``'s other arguments (``train_dataset``, ``data_collator``,
            ``processing_class``, ``callbacks``, ...).

    ``model.config.use_cache`` is set to False (a returned cache cannot be traced).
    Every batch must have the first batch's shapes (see ``FIXED_SHAPES``); one of other
    shapes raises a ``ValueError`` saying how to pad. Each epoch's batch count must be a
    multiple of ``gradient_accumulation_steps``. ``train(resume_from_checkpoint=...)``
    resumes from a ``checkpoint-N`` folder this trainer saved (``save_strategy``): the
    module is planned from the first batch as in a fresh run, then the masters, the
    optimizer and AMP state, the scheduler, RNG and trainer state are restored, and the
    run continues as it would have without the interruption. Not supported: several
    processes (DDP, FSDP, DeepSpeed), ``args.fp16``/``bf16`` (use ``offload_config``),
    ``load_best_model_at_end``, and evaluation with other shapes than training's
    (evaluation with the same shapes runs the module's eval graph, untested). ``grad_norm``
    is not logged: the clipping happens inside ``AMPOptimizer.step``
    (``last_step.grad_norm``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        args: TrainingArguments,
        *,
        memory_budget: float,
        offload_config: OffloadConfig | None = None,
        solver: str = "asyn",
        **kwargs: Any,
    ) -> None:
        if args.fp16 or args.bf16:
            raise ValueError(
                "OffloadTrainer trains in OffloadConfig(dtype=...): leave TrainingArguments "
                "fp16 and bf16 off"
            )
        if args.world_size > 1 or args.deepspeed or args.fsdp:
            raise ValueError("OffloadTrainer trains in one process: no DDP, FSDP or DeepSpeed")
        config = offload_config if offload_config is not None else OffloadConfig()
        self.offload_config = dataclasses.replace(
            config, accumulation_steps=args.gradient_accumulation_steps
        )
        self.memory_budget = memory_budget
        self.solver = solver
        config_of_model = getattr(model, "config", None)
        if getattr(config_of_model, "use_cache", False):
            # A returned key-value cache cannot be traced, and training needs none.
            config_of_model.use_cache = False  # type: ignore[union-attr]
        self.shell = OffloadShell(model)
        self.planned_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        super().__init__(model=self.shell, args=args, **kwargs)

    @property
    def offload_module(self) -> OffloadModule | None:
        """The :class:`OffloadModule` trained (None before training starts)."""
        return self.shell.offload

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # No device placement: the module places its own parameters and the optimizer's
        # state; the Trainer's _prepare_inputs moves the batches.
        self.accelerator.device_placement = False

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Plan and build the module from the first training batch; the AMPOptimizer."""
        if self.optimizer is not None:
            return self.optimizer
        gas = self.args.gradient_accumulation_steps
        loader = self.get_train_dataloader()
        if gas > 1 and len(loader) % gas:
            raise ValueError(
                f"{len(loader)} batches an epoch, not a multiple of "
                f"gradient_accumulation_steps={gas}: AMPOptimizer steps every {gas} batches"
            )
        first = self._prepare_inputs(next(iter(loader)))
        self.planned_shapes = _shapes(first)
        original = self.shell.original
        module = memory_optimize(
            original,
            model_inputs(first),
            self.memory_budget,
            self.solver,
            config=self.offload_config,
            device=self.args.device,
            progress=False,
        )
        decay = set(self.get_decay_parameter_names(original))
        masters = list(module.named_parameters())
        groups = [
            {
                "params": [p for n, p in masters if n in decay],
                "weight_decay": self.args.weight_decay,
            },
            {"params": [p for n, p in masters if n not in decay], "weight_decay": 0.0},
        ]
        adam = HybridAdam(
            [g for g in groups if g["params"]],
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
        )
        amp = AMPOptimizer(adam, module, clipping_norm=max(0.0, self.args.max_grad_norm or 0.0))
        self.shell.offload = module
        self.shell.amp = amp
        self.optimizer = amp
        return amp

    def _check_shapes(self, inputs: Mapping[str, Any]) -> None:
        shapes = _shapes(inputs)
        if self.planned_shapes is not None and shapes != self.planned_shapes:
            raise ValueError(
                f"a batch with tensors {shapes}, but the module was planned for "
                f"{self.planned_shapes}: {FIXED_SHAPES}"
            )

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """:func:`causal_lm_loss` of the module's output; override for other losses."""
        self._check_shapes(inputs)
        outputs = model(**inputs)
        loss = causal_lm_loss(outputs, inputs)
        return (loss, outputs) if return_outputs else loss

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One micro-batch: forward, the loss over the window's length, AMP backward."""
        amp = self.shell.amp
        assert amp is not None, "create_optimizer builds the optimizer before training"
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss: torch.Tensor = self.compute_loss(model, inputs)
        loss = loss / self.current_gradient_accumulation_steps
        amp.backward(loss)
        return loss.detach()

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # AMPOptimizer clips in step() (clipping_norm=args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:
        return None  # known only inside AMPOptimizer.step (amp.last_step.grad_norm)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``optimizer.pt``: the AMPOptimizer's state but the masters, which ``save_model``
        wrote to the weights file beside it; ``scheduler.pt``: the scheduler's."""
        if not self.args.should_save:
            return
        amp = self.shell.amp
        assert amp is not None and self.lr_scheduler is not None, "saved while training"
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(amp.state_dict(masters=False), out / OPTIMIZER_NAME)
        torch.save(self.lr_scheduler.state_dict(), out / SCHEDULER_NAME)

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        """Called by ``train`` before the module exists: only check that the checkpoint
        has the files resuming reads (before the planning, so that a wrong path fails
        fast). :meth:`_load_optimizer_and_scheduler` loads them."""
        folder = Path(resume_from_checkpoint)
        if not folder.is_dir():
            raise ValueError(f"resume_from_checkpoint={str(folder)!r} is not a folder")
        for name in (OPTIMIZER_NAME, SCHEDULER_NAME):
            if not (folder / name).is_file():
                raise ValueError(
                    f"{folder / name} is missing: OffloadTrainer resumes the optimizer, AMP "
                    "and scheduler state from it (a checkpoint saved with "
                    "save_only_model=True, or not by an OffloadTrainer, has none)"
                )
        _weights_file(folder)  # the weights file must be there too

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore the masters from the checkpoint's weights file, the AMPOptimizer's state
        from ``optimizer.pt`` and the scheduler's; the ``Trainer`` calls this once
        ``create_optimizer`` has built the module."""
        if checkpoint is None:
            return
        amp = self.shell.amp
        assert amp is not None and self.lr_scheduler is not None, "create_optimizer ran"
        folder = Path(checkpoint)
        weights_path = _weights_file(folder)
        weights = _read_weights(weights_path)
        _check_weights(weights_path, weights, self.shell.original, amp.module)
        optimizer_path = folder / OPTIMIZER_NAME
        state = torch.load(optimizer_path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{optimizer_path} holds a {type(state).__name__}, not a state dict")
        try:
            # The weights file is the masters' one copy (an optimizer.pt with masters of
            # its own, as AMPOptimizer.state_dict() writes by default, is overridden).
            amp.load_state_dict({**state, "module": weights})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{optimizer_path} does not fit this OffloadTrainer's optimizer: {exc}"
            ) from exc
        scheduler = torch.load(folder / SCHEDULER_NAME, map_location="cpu", weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the fp32 master weights under the original model's state-dict names
        (``save_pretrained`` for a ``PreTrainedModel``, else ``pytorch_model.bin``), the
        processing class and the training arguments."""
        out = Path(output_dir if output_dir is not None else str(self.args.output_dir))
        if not self.args.should_save:
            return
        original = self.shell.original
        module = self.offload_module
        state = original.state_dict()  # references: only its names are read here
        if module is not None:  # non-persistent buffers are left out, as the model does
            trained = module.state_dict()
            state = {name: trained[name] for name in state if name in trained}
        out.mkdir(parents=True, exist_ok=True)
        save_pretrained = getattr(original, "save_pretrained", None)
        if (
            callable(save_pretrained)
            and "state_dict" in inspect.signature(save_pretrained).parameters
        ):
            save_pretrained(str(out), state_dict=state)
        else:
            torch.save(state, out / "pytorch_model.bin")
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(out))
        torch.save(self.args, out / "training_args.bin")
