"""What a model builder returns to the end-to-end benchmark."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    x: Any                                   # this rank's input (a DTensor or a plain local shard)
    to_local: Callable[[Any], torch.Tensor]  # output -> this rank's local tensor (for the loss)
    tokens: int                              # tokens the whole group processes per step


def local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
