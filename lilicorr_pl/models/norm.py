"""RMSNorm for the drafter and the LiLiCorr head: Qwen3's, through one fused op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm


class RMSNorm(Qwen3RMSNorm):
    """Qwen3's RMSNorm (same ``weight`` parameter, same fp32 arithmetic, same cast back before the weight)
    computed with ``F.rms_norm``: one op where Qwen3's forward runs six, which matters where every op is
    overhead (a decoding step of a small drafter or head). Bit-identical to ``Qwen3RMSNorm`` on CPU in fp32
    and bf16 (tested)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        normed = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=self.variance_epsilon)
        return self.weight * normed.to(dtype)
