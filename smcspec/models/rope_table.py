"""The RoPE table of a native model (`llama.LlamaModel`): cos and sin of every position so far,
on the model's device."""

from __future__ import annotations

import torch

from smcspec.models import rope
from smcspec.sampling import to_device


class RopeTable:
    """cos, sin [positions, D] of a RoPE, both scaled by its attention factor, kept on the
    device and grown by doubling as longer sequences arrive. Each position's row is computed
    from that position alone (`rope.angles`, float64), so a table lookup equals computing it
    per call."""

    def __init__(
        self,
        config: rope.Rope,
        dtype: torch.dtype,
        device: torch.device,
        limit: tuple[int, str] | None = None,
    ) -> None:
        """`limit`: (the positions the model takes, why), past which `ensure` refuses."""
        self.config, self.dtype, self.device, self.limit = config, dtype, device, limit
        self.cos = self.sin = torch.zeros(0, config.dim, dtype=dtype, device=device)
        self.pinned = False  # captured CUDA graphs read these very tensors: never move them

    def pin(self, positions: int) -> None:
        """Make the table cover `positions` and never move again (before a graph capture)."""
        self.ensure(positions)
        self.pinned = True

    def ensure(self, positions: int) -> None:
        """Make rows 0 .. positions - 1 available, growing the table (which moves it)."""
        if positions <= self.cos.shape[0]:
            return
        if self.limit is not None and positions > self.limit[0]:
            raise ValueError(
                f"position {positions - 1} is past the {self.limit[0]} positions the native "
                f"engine runs this model to ({self.limit[1]})"
            )
        if self.pinned:
            raise ValueError(
                f"position {positions - 1} is past the {self.cos.shape[0]} positions this model "
                "was prepared for (its context length)"
            )
        size = max(64, 1 << (positions - 1).bit_length())
        if self.limit is not None:
            size = min(size, self.limit[0])
        angles = rope.angles(self.config, torch.arange(size))  # [size, D/2]
        angles = torch.cat([angles, angles], dim=-1)
        scale = self.config.attention_factor
        self.cos = to_device((angles.cos() * scale).to(self.dtype), self.device)
        self.sin = to_device((angles.sin() * scale).to(self.dtype), self.device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [total, D] of positions [total] (on the table's device)."""
        positions = positions.to(self.device)
        return self.cos[positions], self.sin[positions]
