"""flashloop_compile: a torch.compile backend that makes looped transformers cheap to serve.

``torch.compile(model, backend="flashloop", options={...})`` with the flat dict of
:class:`FlashLoopConfig` (or the object itself). All features are off by default.
``export(model, config, "model.pt2", ...)`` writes the compiled prefill and decode programs to one
AOTInductor package; ``load_exported("model.pt2")`` runs it without the model's Python code.

The model classes (``OuroForCausalLM``, ...) are imported on first use, so a process that only
loads an exported package never imports :mod:`flashloop_compile.models`.
"""

from flashloop_compile.config import (
    ConfigError,
    FlashLoopConfig,
    KVResidualQuantization,
    SparseDecodeAttention,
    TokenSparsePrefill,
)
from flashloop_compile.exporter import export
from flashloop_compile.runtime.exported import ExportError, ExportedModel, load_exported

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
    "export",
    "load_exported",
    "ExportError",
    "ExportedModel",
]
__version__ = "0.1.0"


_MODEL_NAMES = ("PRESETS", "OuroConfig", "OuroForCausalLM", "Readout")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        from flashloop_compile.models import ouro

        return getattr(ouro, name)
    raise AttributeError(f"module 'flashloop_compile' has no attribute {name!r}")


def _register_backend() -> None:
    # The installed entry point registers backend="flashloop"; a source checkout (the GPU machine
    # runs the repository as copied) gets the same name on import.
    from flashloop_compile.backend import register

    register()


_register_backend()
