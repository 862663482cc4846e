"""flashloop_compile: a torch.compile backend that makes looped transformers cheap to serve.

``torch.compile(model, backend="flashloop", options={...})`` with the flat dict of
:class:`FlashLoopConfig` (or the object itself). All features are off by default.
"""

from flashloop_compile.config import (
    ConfigError,
    FlashLoopConfig,
    KVResidualQuantization,
    SparseDecodeAttention,
    TokenSparsePrefill,
)
from flashloop_compile.models.ouro import PRESETS, OuroConfig, OuroForCausalLM, Readout

__all__ = [
    "ConfigError",
    "FlashLoopConfig",
    "KVResidualQuantization",
    "SparseDecodeAttention",
    "TokenSparsePrefill",
    "OuroConfig",
    "OuroForCausalLM",
    "PRESETS",
    "Readout",
]
__version__ = "0.1.0"


def _register_backend() -> None:
    # The installed entry point registers backend="flashloop"; a source checkout (the GPU machine
    # runs the repository as copied) gets the same name on import.
    from flashloop_compile.backend import register

    register()


_register_backend()
