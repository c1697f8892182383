"""jcp: multi-LoRA training of Qwen-style models at long context in JAX."""

from jcp.batch import Datum, InputError
from jcp.config import QwenConfig
from jcp.mesh import make_mesh, zigzag_indices, unzigzag

__all__ = ["Datum", "InputError", "QwenConfig", "make_mesh", "zigzag_indices", "unzigzag"]
