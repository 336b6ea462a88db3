"""The Domino baseline head (DESIGN §4.3): a GRU over the block's previous tokens corrects the slot logits.

Slot ``k``'s logits get a residual ``Δ_k = MLP([h_k ; g_k])`` where ``h_k`` is the drafter's slot hidden
state and ``g_k`` the state of a bias-free GRU that has read the frozen target embeddings of
``x_0 .. x_{k-1}`` (``x_0`` = anchor token). Teacher-forced in training (one ``nn.GRU`` call over all
slots); at inference ``S`` sequential V-wide steps, each fed the head's own previous pick.

As the public implementation (vLLM speculators' DFlash with Domino, served by vLLM's proposer): the GRU reads the
embeddings as they are, the correction MLP has no biases, and the first slot keeps the drafter's own logits
(``domino_pure_draft_prefix_len`` 1), so Domino's first draft is DFlash's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lilicorr_pl.heads.base import EmbedFn
from lilicorr_pl.heads.corrector import CorrectorHead


FIRST_FORM = {"uncorrected_slots": 0, "bias": True, "input_norm": True}
"""The form every Domino head had before the reference's became the default: every slot corrected, biases in the
correction MLP, the GRU's input layer-normed. A checkpoint whose recorded head has no ``uncorrected_slots`` was
trained in it, and is rebuilt in it (:func:`as_trained`)."""


def as_trained(head_config: Any) -> Any:
    """A checkpoint's recorded head config with the first form spelled out where it predates the option."""
    if (isinstance(head_config, dict) and str(head_config.get("class_path", "")).endswith(".DominoHead")
            and isinstance(head_config.get("init_args"), dict) and "uncorrected_slots" not in head_config["init_args"]):
        return {**head_config, "init_args": {**head_config["init_args"], **FIRST_FORM}}
    return head_config


def first_form_refusal(recorded: Any, head: Any, where: str) -> str | None:
    """Why a checkpoint (``where``) whose recorded head is a Domino head of the first form cannot load into ``head``
    (a built head, or a run's head config before anything is built), a Domino head of another form (the config that
    trained it builds the reference's now), with the options that build it; None where nothing stands in the way."""
    if as_trained(recorded) is recorded:
        return None
    form = _form_of(head)
    if form is None or form == FIRST_FORM:
        return None
    flags = " ".join(f"--model.head.init_args.{k}={str(v).lower()}" for k, v in FIRST_FORM.items())
    return (f"{where} holds a Domino head of its first form (every slot corrected, biases in the correction MLP, the "
            f"GRU's input layer-normed), which DominoHead's defaults no longer build; add {flags}")


def _form_of(head: Any) -> dict[str, Any] | None:
    """The options :data:`FIRST_FORM` names as ``head`` has them: a built :class:`DominoHead`, or a head config
    (``class_path``/``init_args``, its defaults filled in); None for any other head."""
    if isinstance(head, DominoHead):
        return {k: getattr(head, k) for k in FIRST_FORM}
    if isinstance(head, dict) and str(head.get("class_path", "")).endswith(".DominoHead"):
        given = head.get("init_args") or {}
        defaults = inspect.signature(DominoHead.__init__).parameters
        return {k: given.get(k, defaults[k].default) for k in FIRST_FORM}
    return None


class DominoHead(CorrectorHead):
    """Domino: GRU over previous-token embeddings + low-rank MLP residual on the slot logits.

    ``logits_k = z_k + [σ(w·[h_k ; g_k])] · W_2 SiLU(W_1 [h_k ; g_k])`` for every slot past the first
    ``uncorrected_slots`` (whose logits stay ``z_k``). The last layer starts at zero, so an untrained head
    picks exactly the drafter's top-1. Defaults are the reference's, sized for an 8B target; parameters are
    created by :meth:`build` once the target's sizes are known.
    """

    name = "domino"

    def __init__(
        self,
        gru_hidden: int = 1024,
        rank: int = 256,
        gated: bool = False,
        uncorrected_slots: int = 1,
        bias: bool = False,
        input_norm: bool = False,
    ) -> None:
        """
        Args:
            gru_hidden: hidden size ``H_g`` of the 1-layer, bias-free GRU (1024 for an 8B target).
            rank: width of the low-rank correction MLP ``Linear(H + H_g -> rank) -> SiLU ->
                Linear(rank -> V)`` (256 in the paper).
            gated: multiply the correction by a learned sigmoid gate ``σ(Linear(H + H_g -> 1))``.
            uncorrected_slots: leading slots that keep the drafter's own logits (the reference's
                ``domino_pure_draft_prefix_len``, 1: the first draft is DFlash's); the GRU still reads
                their tokens. 0 corrects every slot.
            bias: biases in the correction MLP's two layers (the reference's have none).
            input_norm: a parameter-free LayerNorm on the GRU's input embeddings (the reference feeds
                them as they are); a variant for targets whose embeddings are very small.
        """
        super().__init__()
        if gru_hidden < 1:
            raise ValueError(f"DominoHead gru_hidden must be >= 1, got {gru_hidden}; the paper uses 1024 for 8B")
        if rank < 1:
            raise ValueError(f"DominoHead rank must be >= 1, got {rank}; the paper uses 256")
        if uncorrected_slots < 0:
            raise ValueError(f"DominoHead uncorrected_slots must be >= 0, got {uncorrected_slots}; the reference "
                             "leaves 1 (the first slot keeps the drafter's logits), 0 corrects every slot")
        self.gru_hidden = gru_hidden
        self.rank = rank
        self.gated = gated
        self.uncorrected_slots = uncorrected_slots
        self.bias = bias
        self.input_norm = input_norm

    def build(self, hidden_size: int, vocab_size: int, *, block_size: int | None = None,
              rms_norm_eps: float | None = None) -> DominoHead:
        """:meth:`Selector.build`; a block whose draft slots (``block_size - 1``) are all left uncorrected is refused
        (the head would never be trained, and DDP stops on its unused parameters)."""
        if block_size is not None and self.uncorrected_slots >= block_size - 1:
            raise ValueError(
                f"DominoHead uncorrected_slots {self.uncorrected_slots} leaves none of the {block_size - 1} draft slots "
                f"of block_size {block_size} corrected, so the head would never train; lower it (the reference's 1) "
                "or use the top1 selector"
            )
        super().build(hidden_size, vocab_size, block_size=block_size, rms_norm_eps=rms_norm_eps)
        return self

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        self.gru = nn.GRU(hidden_size, self.gru_hidden, num_layers=1, bias=False, batch_first=True)
        features = hidden_size + self.gru_hidden
        self.correction = nn.Sequential(
            nn.Linear(features, self.rank, bias=self.bias), nn.SiLU(), nn.Linear(self.rank, vocab_size, bias=self.bias)
        )
        # Zero last layer: the untrained head is the drafter (top-1), and training starts from there.
        nn.init.zeros_(self.correction[2].weight)
        if self.bias:
            nn.init.zeros_(self.correction[2].bias)
        self.gate = nn.Linear(features, 1) if self.gated else None

    # ------------------------------------------------------------------ the recurrence

    @property
    def _dtype(self) -> torch.dtype:
        return self.gru.weight_ih_l0.dtype

    def _gru_input(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        # Detached: the target's table is never trained. input_norm: a parameter-free LayerNorm puts very small
        # embeddings on the GRU's scale (a variant; the reference reads them as they are).
        e = token_embeddings.detach().to(self._dtype)
        return F.layer_norm(e, e.shape[-1:]) if self.input_norm else e

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
        slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One V-wide slot: advance the GRU by ``E[prev_tokens]`` and correct this slot's logits (those of the
        first ``uncorrected_slots`` stay the drafter's)."""
        with torch.no_grad():
            token_embeddings = embed(prev_tokens)  # [b, H]
        out, state = self.gru(self._gru_input(token_embeddings).unsqueeze(1), state)  # [b, 1, H_g]
        if slot < self.uncorrected_slots:
            return slot_logits, state
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
        kept = min(self.uncorrected_slots, slot_logits.shape[1])
        corrected = self._correct(slot_hidden[:, kept:], slot_logits[:, kept:], gru_states[:, kept:])
        return torch.cat([slot_logits[:, :kept].to(corrected.dtype), corrected], dim=1) if kept else corrected
