"""The ``flashloop`` torch.compile backend (registered through the torch_dynamo_backends entry point)."""

from __future__ import annotations

from typing import Any

import torch

from flashloop_compile.config import FlashLoopConfig


def flashloop_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: Any = None):
    config = FlashLoopConfig.coerce(options)
    if config.any_enabled:
        raise NotImplementedError("FlashLoop features are not implemented in the backend yet")
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
