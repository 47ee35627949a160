"""offload-gpt-example: GPT-2 trained on one GPU under a memory budget.

Run ``python -m offload_gpt_example --help`` (or ``bash run.sh`` beside this package) for
the training script; the pieces it is made of are importable:
:mod:`offload_gpt_example.models` (the model zoo, loss and random data) and
:mod:`offload_gpt_example.plot` (the picture of a plan).
"""

from offload_gpt_example.models import (
    DEFAULT_SEQ_LEN,
    VOCAB_SIZE,
    GPTLMModel,
    GPTSpec,
    LlamaLMModel,
    LlamaSpec,
    LMModel,
    WithLMLoss,
    build_model,
    get_spec,
    labels_for,
    lm_loss,
    model_names,
    random_batch,
)
from offload_gpt_example.plot import plan_figure, save_plan_png

__all__ = [
    "DEFAULT_SEQ_LEN",
    "VOCAB_SIZE",
    "GPTLMModel",
    "GPTSpec",
    "LMModel",
    "LlamaLMModel",
    "LlamaSpec",
    "WithLMLoss",
    "build_model",
    "get_spec",
    "labels_for",
    "lm_loss",
    "model_names",
    "plan_figure",
    "random_batch",
    "save_plan_png",
]
