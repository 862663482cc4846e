"""Model implementations the backend is developed against (the backend itself recognizes any
looped model by graph structure, not by these classes)."""

from flashloop_compile.models.ouro import PRESETS, OuroConfig, OuroForCausalLM, Readout

__all__ = ["PRESETS", "OuroConfig", "OuroForCausalLM", "Readout"]
