"""The Domino baseline head (DESIGN §4.3): a GRU over the block's previous tokens corrects the slot logits.

Slot ``k``'s logits get a residual ``Δ_k = MLP([h_k ; g_k])`` where ``h_k`` is the drafter's slot hidden
state and ``g_k`` the state of a bias-free GRU that has read the frozen target embeddings of
``x_0 .. x_{k-1}`` (``x_0`` = anchor token). Teacher-forced in training (one ``nn.GRU`` call over all
slots); at inference ``S`` sequential V-wide steps, each fed the head's own previous pick.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lilicorr_pl.heads.base import EmbedFn
from lilicorr_pl.heads.corrector import CorrectorHead


class DominoHead(CorrectorHead):
    """Domino: GRU over previous-token embeddings + low-rank MLP residual on the slot logits.

    ``logits_k = z_k + [σ(w·[h_k ; g_k])] · W_2 SiLU(W_1 [h_k ; g_k] + b_1) + b_2``. The last layer starts
    at zero, so an untrained head picks exactly the drafter's top-1. Defaults are sized for an 8B
    target; parameters are created by :meth:`build` once the target's sizes are known.
    """

    name = "domino"

    def __init__(self, gru_hidden: int = 1024, rank: int = 256, gated: bool = False) -> None:
        """
        Args:
            gru_hidden: hidden size ``H_g`` of the 1-layer, bias-free GRU (1024 for an 8B target).
            rank: width of the low-rank correction MLP ``Linear(H + H_g -> rank) -> SiLU ->
                Linear(rank -> V)`` (256 in the paper).
            gated: multiply the correction by a learned sigmoid gate ``σ(Linear(H + H_g -> 1))``.
        """
        super().__init__()
        if gru_hidden < 1:
            raise ValueError(f"DominoHead gru_hidden must be >= 1, got {gru_hidden}; the paper uses 1024 for 8B")
        if rank < 1:
            raise ValueError(f"DominoHead rank must be >= 1, got {rank}; the paper uses 256")
        self.gru_hidden = gru_hidden
        self.rank = rank
        self.gated = gated

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        self.gru = nn.GRU(hidden_size, self.gru_hidden, num_layers=1, bias=False, batch_first=True)
        features = hidden_size + self.gru_hidden
        self.correction = nn.Sequential(
            nn.Linear(features, self.rank), nn.SiLU(), nn.Linear(self.rank, vocab_size)
        )
        # Zero last layer: the untrained head is the drafter (top-1), and training starts from there.
        nn.init.zeros_(self.correction[2].weight)
        nn.init.zeros_(self.correction[2].bias)
        self.gate = nn.Linear(features, 1) if self.gated else None

    # ------------------------------------------------------------------ the recurrence

    @property
    def _dtype(self) -> torch.dtype:
        return self.gru.weight_ih_l0.dtype

    def _gru_input(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        # Frozen embeddings are tiny (std ~0.01-0.02 in large LMs); a parameter-free LayerNorm puts them
        # on the GRU's scale without adding a bias. Detached: the target's table is never trained.
        e = token_embeddings.detach().to(self._dtype)
        return F.layer_norm(e, e.shape[-1:])

    def _correct(self, slot_hidden: torch.Tensor, slot_logits: torch.Tensor, gru_state: torch.Tensor) -> torch.Tensor:
        features = torch.cat([slot_hidden.to(self._dtype), gru_state], dim=-1)  # [..., H + H_g]
        delta = self.correction(features)  # [..., V]
        if self.gate is not None:
            delta = torch.sigmoid(self.gate(features)) * delta
        return slot_logits + delta

    def initial_state(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """Zero GRU state ``[1, b, H_g]`` (what ``nn.GRU`` uses when given none)."""
        return torch.zeros(1, batch_size, self.gru_hidden, device=device, dtype=self._dtype)

    def step(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        state: torch.Tensor,
        embed: EmbedFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One V-wide slot: advance the GRU by ``E[prev_tokens]`` and correct this slot's logits."""
        with torch.no_grad():
            token_embeddings = embed(prev_tokens)  # [b, H]
        out, state = self.gru(self._gru_input(token_embeddings).unsqueeze(1), state)  # [b, 1, H_g]
        return self._correct(slot_hidden, slot_logits, out.squeeze(1)), state

    def corrected_logits(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        embed: EmbedFn,
    ) -> torch.Tensor:
        """Teacher-forced corrected logits ``[M, S, V]``: one GRU pass over ``E[prev_tokens]``."""
        self._check_inputs(slot_hidden, slot_logits, prev_tokens)
        with torch.no_grad():
            token_embeddings = embed(prev_tokens)  # [M, S, H]
        gru_states, _ = self.gru(self._gru_input(token_embeddings))  # [M, S, H_g]; zero initial state
        return self._correct(slot_hidden, slot_logits, gru_states)
