"""The selector interface shared by every arm (DESIGN §4).

Every arm runs the same DFlash backbone and differs only in how the drafted block is chosen from the
drafter's slot outputs. One interface, two calls, declared types:

- **training** — ``head(draft, TeacherForcing(...)) -> HeadOutput``: the lattice (lattice heads), the
  teacher-forced corrected logits (corrector heads) and the tokens the head would select, which the
  system hands to the losses and the diagnostics;
- **decoding** — ``head.select(draft, SelectContext(...)) -> Selection``: the drafted tokens and, when
  the context asks for sampled drafts, the proposal ``q`` they were drawn from.

What a head needs and returns is declared by the class attributes of :class:`Selector`
(``uses_lattice``, ``uses_corrector``, ``parameter_free``, ``name``), never probed. The speculative
decoding loop, the metrics and the benchmark only ever call these, so adding an arm means adding a
:class:`Selector` subclass (and its ``name`` to :data:`lilicorr_pl.heads.SELECTORS`).

Notation: ``M`` blocks (batch × anchors, flattened), ``S = B − 1`` speculative slots, ``K`` lattice
width, ``V`` vocabulary rows, ``H`` target hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import nn

from lilicorr_pl.heads.lattice import Decode, walk
from lilicorr_pl.heads.sampling import DraftSampling
from lilicorr_pl.models.dflash import DraftOutput

EmbedFn = Callable[[torch.Tensor], torch.Tensor]
"""Token ids ``[...]`` -> frozen target input embeddings ``[..., H]``."""


@dataclass
class Lattice:
    """The top-K candidate lattice of a batch of blocks and its log-potential scores.

    A path picks one candidate per slot; its score is ``start[j_1] + Σ_s pair[s, j_s, j_{s+1}]``.
    """

    candidates: torch.Tensor
    """``[M, S, K]`` long: rank-ordered top-K token ids of the drafter logits (rank 0 = top-1)."""
    start: torch.Tensor
    """``[M, K]``: start scores of the candidates at the first speculative slot (index 0)."""
    pair: torch.Tensor
    """``[M, S-1, K, K]``: ``pair[m, s, i, j]`` scores candidate ``i`` at slot ``s`` -> ``j`` at ``s+1``."""
    candidate_logprobs: torch.Tensor
    """``[M, S, K]``: drafter log-probabilities of the candidates (live: carries gradient)."""

    @property
    def num_slots(self) -> int:
        """``S``, the number of speculative slots."""
        return self.candidates.shape[1]

    @property
    def top_k(self) -> int:
        """``K``, the number of candidates per slot."""
        return self.candidates.shape[2]

    def walk(self, decode: Decode = "greedy") -> torch.Tensor:
        """The T = 0 path ``[M, S]`` (candidate ranks): :func:`~lilicorr_pl.heads.lattice.greedy_walk`
        or, with ``decode="viterbi"``, :func:`~lilicorr_pl.heads.lattice.viterbi` (scores detached)."""
        return walk(self.start.detach(), self.pair.detach(), decode)

    def tokens_at(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids ``[M, S]`` of the candidate ranks ``index [M, S]``."""
        return self.candidates.gather(-1, index.unsqueeze(-1)).squeeze(-1)


@dataclass
class Selection:
    """A drafted block chosen by :meth:`Selector.select`."""

    tokens: torch.Tensor
    """``[b, S]`` long: the chosen draft tokens."""
    q: torch.Tensor | None = None
    """``[b, S, V]`` float32: the proposal distribution each slot's token was drawn from, when the
    context asked for sampled drafts (``SelectContext.sampling``); None for a deterministic draft
    (the point-mass rule is then its exact acceptance rule). Slot ``k``'s row may depend on the tokens
    drawn at slots ``< k``, never on later ones."""
    lattice_index: torch.Tensor | None = None
    """``[b, S]`` long: the chosen candidate rank per slot, when a lattice was used."""
    lattice: Lattice | None = None
    """The lattice the tokens were chosen from, when one was used."""


@dataclass
class SelectContext:
    """What a selector knows about the block beyond the drafter's outputs (decoding)."""

    anchor_tokens: torch.Tensor
    """``[b]`` long: the anchor ``x_0`` each block starts from (the last committed token)."""
    anchor_positions: torch.Tensor
    """``[b]`` long: the anchor's absolute position in its sequence (prompt tokens included)."""
    embed: EmbedFn
    """Token ids -> frozen target input embeddings."""
    sampling: DraftSampling | None = None
    """None: choose deterministically (T = 0, or the point-mass rule at T > 0). Otherwise sample the
    draft at this temperature / top-p and return the proposal in :attr:`Selection.q`."""


@dataclass
class TeacherForcing:
    """What a head reads in training besides the drafter's outputs: the true tokens of each block."""

    anchor_tokens: torch.Tensor
    """``[M]`` long: each block's anchor token ``x_0``."""
    labels: torch.Tensor
    """``[M, S]`` long: the true tokens of the slots (arbitrary where unsupervised); slot ``k`` is
    conditioned on ``labels[:, k-1]`` (the anchor for ``k = 0``) by heads that read previous tokens."""
    embed: EmbedFn
    """Token ids -> frozen target input embeddings."""

    @property
    def previous_tokens(self) -> torch.Tensor:
        """``[M, S]``: the token before each slot under teacher forcing (anchor, then the true tokens)."""
        return torch.cat([self.anchor_tokens.view(-1, 1).to(self.labels), self.labels[:, :-1]], dim=1)


@dataclass
class HeadOutput:
    """What a head's training call returns (the losses and diagnostics read it)."""

    selected: torch.Tensor
    """``[M, S]`` long, no gradient: the tokens the head picks at T = 0 under teacher forcing (the
    lattice walk, the corrected argmax, the drafter's top-1)."""
    lattice: Lattice | None = None
    """The scored lattice (lattice heads: ``uses_lattice``); the lattice losses train it."""
    corrected_logits: torch.Tensor | None = None
    """``[M, S, V]`` live teacher-forced corrected logits (corrector heads: ``uses_corrector``)."""


class Selector(nn.Module):
    """Base class: chooses a drafted block from the drafter's slot outputs (one interface for every arm).

    Subclasses create their parameters in :meth:`_build_layers` (called by :meth:`build` once the
    frozen target's sizes are known), choose tokens in :meth:`select` and, when they train, return
    their training outputs from :meth:`forward`.
    """

    name: ClassVar[str] = ""
    """Registry name (``lilicorr bench --selectors``); empty for selectors that are not registered."""
    uses_lattice: ClassVar[bool] = False
    """:meth:`forward` returns a :class:`Lattice` (``HeadOutput.lattice``): lattice losses apply."""
    uses_corrector: ClassVar[bool] = False
    """:meth:`forward` returns ``HeadOutput.corrected_logits``: corrector losses apply."""
    parameter_free: ClassVar[bool] = False
    """No weights to learn or load: a fresh instance works with any checkpoint's drafter."""
    top_k: int = 8
    """Lattice width ``K``: the candidates a lattice head keeps, and for other heads the width of the
    drafter's top-K oracle in the diagnostics."""

    def __init__(self) -> None:
        super().__init__()
        self.target_hidden_size: int | None = None
        self.vocab_size: int | None = None

    @property
    def is_built(self) -> bool:
        """Whether :meth:`build` has run (and created any parameters)."""
        return self.target_hidden_size is not None

    def build(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        block_size: int | None = None,
        rms_norm_eps: float | None = None,
    ) -> "Selector":
        """Create parameters once the target's sizes are known. Idempotent; returns ``self``.

        A different size after building is an error (the parameters would not fit the checkpoint).
        Subclasses create their layers in :meth:`_build_layers`.

        Args:
            hidden_size: hidden size ``H`` of the frozen target (= drafter width).
            vocab_size: number of rows ``V`` of the target's LM head.
            block_size: the drafter's block size ``B``, for heads whose parameters depend on it (the
                LiLiCorr head's slot tables); ignored by the others.
            rms_norm_eps: the drafter's RMSNorm epsilon, for heads that share the drafter's norms in
                the serving layout (LiLiCorr); ignored by the others.
        """
        name = type(self).__name__
        if hidden_size < 1 or vocab_size < 1:
            raise ValueError(f"{name} needs positive sizes, got hidden_size {hidden_size}, vocab_size {vocab_size}")
        if self.is_built:
            if (self.target_hidden_size, self.vocab_size) != (hidden_size, vocab_size):
                raise ValueError(
                    f"{name} was built for hidden_size {self.target_hidden_size} and vocab_size "
                    f"{self.vocab_size}, now asked for {hidden_size} and {vocab_size}; create a new head "
                    f"for a different target"
                )
            return self
        self.target_hidden_size, self.vocab_size = hidden_size, vocab_size
        self._build_layers(hidden_size, vocab_size)
        return self

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        """Create the selector's parameters (none by default)."""

    def forward(self, draft: DraftOutput, context: TeacherForcing) -> HeadOutput:
        """Training call: teacher-forced outputs of ``M`` blocks (default: the drafter's top-1, nothing to train).

        Args:
            draft: the drafter's outputs of the blocks (``slot_hidden [M, S, H]``, live ``slot_logits
                [M, S, V]``, ``anchor_feature [M, H]``, ``anchor_feature_valid [M]``).
            context: the blocks' anchor and true tokens.
        """
        return HeadOutput(selected=draft.slot_logits.detach().argmax(dim=-1))

    def select(self, draft: DraftOutput, context: SelectContext) -> Selection:
        """Choose the draft tokens of each block (inference path; the caller wraps it in ``no_grad``).

        Args:
            draft: the drafter's outputs of ``b`` blocks (``slot_hidden [b, S, H]``, ``slot_logits
                [b, S, V]``, ``anchor_feature [b, H]``, ``anchor_feature_valid [b]``).
            context: anchor tokens and positions, the embedding, and whether to sample.

        Returns:
            The tokens; with ``context.sampling`` also the proposal ``q`` they were drawn from.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement select()")
