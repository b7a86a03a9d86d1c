"""Row transforms applied to merged blocks before encoding (one function per Transform.kind)."""

from __future__ import annotations

import torch


def permute_qk(x: torch.Tensor, unit: int) -> torch.Tensor:
    """HF rotary layout -> GGUF's (convert_hf_to_gguf's permute), for whole heads of ``unit`` rows.

    Within each head, row (k * unit/2 + j) moves to (2j + k): the two rotary
    halves are interleaved.
    """
    rows, cols = x.shape
    return x.reshape(rows // unit, 2, unit // 2, cols).transpose(1, 2).reshape(rows, cols)


TRANSFORMS = {"permute_qk": permute_qk}
