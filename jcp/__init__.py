"""jcp: multi-LoRA training of Qwen-style models at long context in JAX."""

# First, before JAX's CPU client and its threads exist (see jcp/host_memory.py).
from jcp import host_memory  # noqa: F401  (isort: skip)
from jcp.batch import Datum
from jcp.config import QwenConfig
from jcp.custom_loss import CustomLoss
from jcp.errors import InputError
from jcp.hf import load_hf
from jcp.mesh import make_mesh, unzigzag, zigzag_indices
from jcp.sample import PromptFields, SampledSequence, SampleResult, SamplingParams, TopK
from jcp.trainer import AdamParams, ForwardBackwardOutput, Trainer

__all__ = [
    "AdamParams",
    "CustomLoss",
    "Datum",
    "ForwardBackwardOutput",
    "Trainer",
    "InputError",
    "PromptFields",
    "QwenConfig",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "TopK",
    "load_hf",
    "make_mesh",
    "unzigzag",
    "zigzag_indices",
]
