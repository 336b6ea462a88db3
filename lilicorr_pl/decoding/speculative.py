"""Speculative decoding with a DFlash drafter and any selector, plus the plain-decoding baseline (DESIGN §7).

One round: the drafter proposes a block ``[anchor, d_1..d_S]`` in one forward pass, the selector picks
``d_1..d_S``, and the frozen target verifies the whole block in one forward pass over its KV cache.
``y_k`` is the target's own choice after block token ``k`` (argmax at T = 0, a sample at T > 0);
``acc`` is the longest prefix with ``d_{k+1} == y_k``; the anchor and ``acc`` drafts are committed and
``y_acc`` (the *bonus* token) becomes the next anchor. τ for the round is ``acc + 1``: it **includes**
the bonus token, so ``1 <= τ <= B``.

Losslessness: at T > 0 the selector samples its block and returns the proposal ``q`` each draft was
drawn from (``draft_sampling="proposal"``, what the serving references do); drafts are verified with
the standard ``min(1, p/q)`` rule and ``max(p − q, 0)`` residual resampling
(:func:`speculative_sampling_accept`). The alternative ``draft_sampling="point_mass"`` drafts
deterministically and accepts a draft iff it equals the target's own sample: exactly the
speculative-sampling rule for a point-mass ``q``. Either way the output is distributed as plain target
sampling; at T = 0 it equals greedy target decoding token for token.

Batch size 1 for now; the helpers work on ``[b, ...]`` tensors so batching can be added later.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from lilicorr_pl.heads.base import Selection, SelectContext, Selector
from lilicorr_pl.heads.sampling import DraftSampling, draw, warp_probs
from lilicorr_pl.target import FrozenTarget

DraftSamplingRule = Literal["proposal", "point_mass"]
"""How drafts are made and verified at T > 0.

``"proposal"`` (the serving references' rule, the default): the selector samples its block and
returns the proposal ``q``; drafts are verified with ``min(1, p/q)`` and the ``max(p − q, 0)``
residual. ``"point_mass"``: the selector drafts deterministically (as at T = 0) and a draft is
accepted iff it equals the target's own sample — the same rule for a point-mass ``q``. Both are
lossless; they differ in τ. At T = 0 both are greedy."""
DRAFT_SAMPLING_RULES: tuple[str, ...] = get_args(DraftSamplingRule)

__all__ = [
    "DRAFT_SAMPLING_RULES",
    "DraftSamplingRule",
    "GenerationResult",
    "default_stop_token_ids",
    "draft_sampling_for",
    "greedy_accept",
    "sample_tokens",
    "speculative_generate",
    "speculative_sampling_accept",
    "target_generate",
    "verify_block",
    "warp_probs",
]


@dataclass
class GenerationResult:
    """What one generation returns. All timings are wall-clock seconds.

    On CUDA with ``timing=True`` the phases are timed by CUDA events recorded on the target's stream at
    each phase boundary and read once, after the generation's last transfer: the split is device time and
    timing adds no synchronisation (the round's one transfer to the host is the only one). Without it the
    phase split says where launches were made, not where the device spent its time. ``total`` is always
    host time, measured after the last token reached the host.

    τ counts committed tokens per verify round **including the target's bonus token**:
    ``τ_round = accepted + 1``. Stops truncate the last round's output, so ``len(tokens)`` can be
    smaller than ``1 + Σ τ_round`` (the leading 1 is the token sampled from the prefill).
    """

    tokens: list[int]
    """Generated token ids, prompt excluded; a stop token, when hit, is the last entry."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Per verify round, accepted draft tokens ``acc`` in ``0..S`` (τ_round = acc + 1, bonus included).
    Recorded as verified, before any stop truncation. Empty for plain target decoding."""
    num_rounds: int = 0
    """Verify rounds (= ``len(accepted_lengths)``; 0 for plain target decoding)."""
    tau: float = 1.0
    """Mean ``acc + 1`` over rounds: acceptance length **including the bonus token** (1.0 for plain
    decoding and when no round ran)."""
    prefill: float = 0.0
    """Target prefill over the prompt plus the first sample."""
    draft: float = 0.0
    """Drafter forward passes."""
    head: float = 0.0
    """Selector (top-1, LiLiCorr, …) time, measured separately from the drafter."""
    verify: float = 0.0
    """Target forward passes after the prefill (with the block's assembly): verify passes
    (speculative) or decode steps (plain)."""
    bookkeeping: float = 0.0
    """Everything else in the decode loop: sampling / acceptance, the host transfer, cache crops,
    committing tokens and stop checks. ``draft + head + verify + bookkeeping`` is the loop's time."""
    total: float = 0.0
    """End-to-end time of the call."""
    stopped_on: str = "max_new_tokens"
    """``"eos"`` (a stop token was generated) or ``"max_new_tokens"``."""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    """The first ``record_rounds`` rounds for display: ``anchor``, ``drafted`` (d_1..d_S),
    ``target`` (y_0..y_S, the target's choices after each block token; None under the proposal
    rule, which draws no such row), ``accepted`` (acc),
    ``committed`` (accepted drafts + bonus, before truncation)."""
    prompt_length: int = 0
    """Prompt tokens ``P``."""
    target_calls: int = 0
    """Target forward passes, prefill included."""

    @property
    def num_tokens(self) -> int:
        """Generated tokens (prompt excluded)."""
        return len(self.tokens)

    @property
    def num_steps(self) -> int:
        """Timed decode steps: verify rounds (speculative) or single-token target steps (plain)."""
        return self.num_rounds if self.num_rounds else max(self.target_calls - 1, 0)

    @property
    def step_seconds(self) -> float:
        """Decode-loop time (``draft + head + verify + bookkeeping``): the sum over :attr:`num_steps`."""
        return self.draft + self.head + self.verify + self.bookkeeping

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of ``total`` time."""
        return len(self.tokens) / self.total if self.total > 0 else float("nan")


# ---------------------------------------------------------------------------------------- sampling
def sample_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The target's choice at every position: ``logits [..., V]`` -> ``[...]`` long.

    Argmax at ``temperature == 0``; otherwise one independent draw per position from
    :func:`warp_probs`. Plain and speculative decoding both sample through this function.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    return draw(warp_probs(logits, temperature, top_p), generator)


def greedy_accept(
    draft_tokens: torch.Tensor, target_choices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance for deterministic drafts (point-mass ``q``): accept ``d_{k+1}`` iff it equals ``y_k``.

    Args:
        draft_tokens: ``[b, S]`` drafted tokens ``d_1..d_S``.
        target_choices: ``[b, S+1]`` target choices ``y_0..y_S`` after ``anchor, d_1..d_S``.

    Returns:
        ``(acc [b], next_token [b])``: accepted drafts and the bonus token ``y_acc``.
    """
    match = (draft_tokens == target_choices[:, :-1]).long()  # [b, S]
    acc = match.cumprod(dim=-1).sum(dim=-1)  # [b] longest matching prefix
    return acc, target_choices.gather(1, acc.unsqueeze(1)).squeeze(1)


def speculative_sampling_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard speculative-sampling rule for a stochastic draft.

    Draft ``d_{k+1}`` was drawn from ``q_k``; it is accepted with probability
    ``min(1, p_k(d) / q_k(d))``. At the first rejection the bonus token is drawn from the residual
    ``normalise(max(0, p_k − q_k))``; if every draft is accepted it is drawn from ``p_S``. The committed
    tokens are then distributed exactly as sampling from ``p``.

    Args:
        draft_tokens: ``[b, S]`` drafted tokens.
        draft_probs: ``[b, S, V]`` the distributions ``q`` the drafts were drawn from.
        target_probs: ``[b, S+1, V]`` target distributions ``p`` after ``anchor, d_1..d_S``
            (already temperature/top-p warped).
        generator: RNG for the acceptance uniforms and the residual draw.

    Returns:
        ``(acc [b], next_token [b])``.
    """
    b, s = draft_tokens.shape
    p = target_probs.float()
    q = draft_probs.float()
    p_d = p[:, :s].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [b, S]
    q_d = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [b, S]
    rng_device = generator.device if generator is not None else p.device
    u = torch.rand(b, s, generator=generator, device=rng_device).to(p.device)  # [b, S]
    accept = (u * q_d < p_d).long()  # u < p/q without dividing by q
    acc = accept.cumprod(dim=-1).sum(dim=-1)  # [b]
    # Residual at every position; q is padded with zeros at position S, so the residual there is p_S.
    residual = (p - torch.cat([q, q.new_zeros(b, 1, q.shape[-1])], dim=1)).clamp_(min=0.0)
    rows = residual.gather(1, acc.view(b, 1, 1).expand(b, 1, p.shape[-1])).squeeze(1)  # [b, V]
    p_rows = p.gather(1, acc.view(b, 1, 1).expand(b, 1, p.shape[-1])).squeeze(1)
    # p == q at a rejected position has probability zero; guard against rounding all the same.
    empty = rows.sum(-1, keepdim=True) <= 0
    rows = torch.where(empty, p_rows, rows)
    return acc, draw(rows / rows.sum(-1, keepdim=True), generator)


def draft_sampling_for(
    rule: DraftSamplingRule, temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None
) -> DraftSampling | None:
    """The selector's sampling settings for a round: None (deterministic drafts) at T = 0 or under the
    point-mass rule, else the target's temperature / top-p and RNG (the proposal rule)."""
    if rule not in DRAFT_SAMPLING_RULES:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING_RULES}, got {rule!r}")
    if temperature == 0 or rule == "point_mass":
        return None
    return DraftSampling(temperature, top_p, generator)


def verify_block(
    drafts: torch.Tensor,
    selection: Selection,
    target_logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One round's acceptance: how many drafts the target keeps and the bonus token.

    With a proposal (``selection.q``, T > 0): :func:`speculative_sampling_accept`, ``min(1, p/q)``
    and residual resampling. Otherwise the point-mass rule, :func:`greedy_accept` against the target's
    own choices (argmax at T = 0, samples at T > 0) — the exact rule for a deterministic draft.

    Args:
        drafts: ``[b, S]`` drafted tokens ``d_1..d_S``.
        selection: what the selector returned for them (its ``q``, if any).
        target_logits: ``[b, S+1, V]`` target logits after ``anchor, d_1..d_S``.

    Returns:
        ``(acc [b], bonus [b], choices [b, S+1] or None)``: ``choices`` are the target's own choices
        under the point-mass rule (None under the proposal rule, which draws no such row).
    """
    if selection.q is not None and temperature > 0:
        p = warp_probs(target_logits, temperature, top_p)  # [b, S+1, V]
        acc, bonus = speculative_sampling_accept(drafts, selection.q.to(p.device), p, generator)
        return acc, bonus, None
    choices = sample_tokens(target_logits, temperature, top_p, generator)  # [b, S+1]
    acc, bonus = greedy_accept(drafts, choices)
    return acc, bonus, choices


# ---------------------------------------------------------------------------------------- helpers
def default_stop_token_ids(target: FrozenTarget) -> list[int]:
    """The target's stop ids: :func:`lilicorr_pl.target.stop_token_ids`, the one place regeneration uses too."""
    return target.stop_token_ids()


def _stop_set(target: FrozenTarget, stop_token_ids: Sequence[int] | None) -> set[int]:
    if stop_token_ids is None:
        return set(default_stop_token_ids(target))
    return {int(t) for t in stop_token_ids}


def _prompt_tensor(input_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"speculative decoding supports one prompt at a time (batch size 1); got input_ids of shape "
            f"{tuple(ids.shape)}. Pass a [1, P] tensor or a list of token ids."
        )
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty; pass at least one token (e.g. BOS or a chat template)")
    return ids


class _Clock:
    """The phase clock of one generation: ``mark()`` at each phase boundary, ``add`` a phase between two marks,
    ``settle`` once at the end.

    On a CPU, or on CUDA untimed, a mark is the host clock (on CUDA untimed: launch times). Timed on CUDA
    (``timing=True`` in the public functions) a mark is a CUDA event recorded on the device's current stream, and
    the phases are summed from the events' elapsed times in :meth:`settle`, after the generation's last transfer:
    device time, with no synchronisation added per phase (a synchronisation at every boundary, as before, slowed
    the tokens/s measured in the same run by three waits a round).
    """

    def __init__(self, device: torch.device, timed: bool = False) -> None:
        self.device = device
        self.events = timed and device.type == "cuda"
        self._pending: list[tuple[str, Any, Any]] = []

    def mark(self) -> Any:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, result: "GenerationResult", phase: str, start: Any, end: Any) -> None:
        """Add the time from mark ``start`` to mark ``end`` to ``result``'s ``phase`` (later, for events)."""
        if self.events:
            self._pending.append((phase, start, end))
        else:
            setattr(result, phase, getattr(result, phase) + (end - start))

    def settle(self, result: "GenerationResult") -> None:
        """Sum the events' phases into ``result``: one wait, for the last event, per generation."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()  # events complete in stream order: the last one covers all
        for phase, start, end in self._pending:
            setattr(result, phase, getattr(result, phase) + start.elapsed_time(end) / 1000.0)
        self._pending.clear()


@contextlib.contextmanager
def _eval_mode(*modules: Any) -> Iterator[None]:
    """Run modules in eval mode, restoring each submodule's training flag afterwards."""
    saved = [(m, m.training) for mod in modules if isinstance(mod, nn.Module) for m in mod.modules()]
    for mod in modules:
        if isinstance(mod, nn.Module):
            mod.eval()
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def _positions(start: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device).unsqueeze(0)  # [1, length]


def _commit(tokens: list[int], new: Sequence[int], stops: set[int], max_new_tokens: int) -> str | None:
    """Append ``new`` until a stop token (kept) or the token budget; returns why it stopped, if it did."""
    for tok in new:
        tokens.append(int(tok))
        if tok in stops:
            return "eos"
        if len(tokens) >= max_new_tokens:
            return "max_new_tokens"
    return None


def _prefill(
    target: FrozenTarget,
    prompt: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Target over the prompt: ``(first_token [1], features [1, P, n*H], cache)``."""
    out = target(prompt, position_ids=_positions(0, prompt.shape[1], prompt.device), use_cache=True)
    logits = target.lm_head(out.normed_hidden[:, -1:])  # [1, 1, V]: only the last position is needed
    first = sample_tokens(logits, temperature, top_p, generator)[:, 0]
    return first, out.features, out.cache


def _finish(result: GenerationResult, start: float, clock: _Clock) -> GenerationResult:
    # Every committed token already went through the host (``tolist``), so no device sync is needed. Taken before the
    # phase events are read, so reading them costs the tokens/s nothing.
    result.total = time.perf_counter() - start
    clock.settle(result)
    result.num_rounds = len(result.accepted_lengths)
    if result.accepted_lengths:
        result.tau = sum(result.accepted_lengths) / result.num_rounds + 1.0
    return result


# ---------------------------------------------------------------------------------------- decoding
@torch.inference_mode()
def speculative_generate(
    target: FrozenTarget,
    drafter: Any,
    selector: Selector,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    record_rounds: int = 0,
    timing: bool = False,
    draft_sampling: DraftSamplingRule = "proposal",
) -> GenerationResult:
    """Speculative decoding of one prompt (DESIGN §7); lossless with respect to the target.

    Args:
        target: the frozen target; its KV cache is used for prefill and verification.
        drafter: a built :class:`~lilicorr_pl.models.dflash.DFlashDrafter` (or anything with
            ``new_cache()``, ``draft(...)``, ``num_slots``).
        selector: a :class:`~lilicorr_pl.heads.Selector`; ``select(draft, SelectContext)`` chooses
            ``d_1..d_S`` from the drafter outputs, given the anchor token and its position.
        input_ids: the prompt, ``[1, P]`` / ``[P]`` tensor or a list of ids.
        max_new_tokens: generation budget; the last block is truncated to it.
        temperature: 0 = greedy (output equals plain greedy decoding); > 0 samples ``softmax(z/T)``.
        top_p: nucleus truncation of the target distribution when sampling.
        stop_token_ids: generation stops after the first of these (it is kept in the output);
            None = :func:`default_stop_token_ids`, ``[]`` = never stop early.
        generator: RNG for sampling (on the target's device).
        record_rounds: keep drafted/accepted details of this many leading rounds in ``rounds``.
        timing: on CUDA, time the draft / head / verify / bookkeeping split with CUDA events, read once at the
            end, so it is device time rather than launch time (no synchronisation added; CPU timings are exact
            either way).
        draft_sampling: the T > 0 rule (:data:`DraftSamplingRule`): ``"proposal"`` — the selector
            samples its block and returns ``q``, verified with ``min(1, p/q)`` and residual
            resampling (a selector that returns no ``q`` drafted deterministically and gets the
            point-mass rule); ``"point_mass"`` — deterministic drafts accepted iff equal to the
            target's sample. Ignored at T = 0.

    Returns:
        A :class:`GenerationResult`; ``tau`` is the mean acceptance length **including the bonus
        token**. Per round it times the drafter (``draft``), the selector (``head``), the target's
        verify pass (``verify``) and the rest of the round (``bookkeeping``).
    """
    clock = _Clock(target.device, timed=timing)
    # No device sync first (timing used to make one): a caller's queued kernels would count in ``total``, but bench's
    # generations each end with the host holding every token, so none are queued.
    start, first = time.perf_counter(), clock.mark()
    prompt = _prompt_tensor(input_ids, target.device)
    stops = _stop_set(target, stop_token_ids)
    sampling = draft_sampling_for(draft_sampling, temperature, top_p, generator)  # None: deterministic drafts
    result = GenerationResult(tokens=[], prompt_length=prompt.shape[1])
    if max_new_tokens <= 0:
        return _finish(result, start, clock)
    num_slots = int(drafter.num_slots)
    device = prompt.device

    with _eval_mode(drafter, selector):
        # 1. Prefill: the first token becomes the anchor; all prompt features go to the drafter.
        anchor, pending_features, cache = _prefill(target, prompt, temperature, top_p, generator)
        committed = prompt.shape[1]  # tokens in the target cache (the anchor is not yet in it)
        result.target_calls = 1
        clock.add(result, "prefill", first, clock.mark())
        stopped = _commit(result.tokens, [int(anchor[0])], stops, max_new_tokens)
        draft_cache = drafter.new_cache()
        # Position ids of every possible verify block, built once: [1, P + max_new_tokens + B].
        positions = _positions(0, committed + max_new_tokens + num_slots + 1, device)
        t = clock.mark()

        while stopped is None:
            # 2. Draft: one drafter pass over [anchor, MASK x S], then the selector.
            out = drafter.draft(draft_cache, pending_features, anchor, target.embed, target.lm_head)
            t_draft = clock.mark()
            # The anchor sits at position `committed` (right after the tokens in the target cache).
            context = SelectContext(anchor.view(1), positions[0, committed : committed + 1], target.embed, sampling)
            selection = selector.select(out, context)
            drafts = selection.tokens.to(device=device, dtype=torch.long).view(1, num_slots)  # [1, S]
            t_head = clock.mark()

            # 3. Verify: one target pass over [anchor, d_1..d_S] on top of the committed cache.
            block = torch.cat([anchor.view(1, 1), drafts], dim=1)  # [1, S+1]
            ver = target(
                block,
                attention_mask=target.block_mask(committed, num_slots + 1),
                position_ids=positions[:, committed : committed + num_slots + 1],
                cache=cache,
                use_cache=True,
                return_logits=True,
            )
            t_verify = clock.mark()
            cache = ver.cache if ver.cache is not None else cache
            acc_t, anchor, choices = verify_block(drafts, selection, ver.logits, temperature, top_p, generator)
            # The round's only device-to-host transfer: acc, the bonus token and the drafts.
            host = torch.cat([acc_t.view(1), anchor.view(1), drafts[0]]).tolist()
            acc, bonus = host[0], host[1]
            # Commit anchor + acc drafts: crop the rejected tail; their features feed the next draft.
            committed += acc + 1
            FrozenTarget.crop_cache(cache, committed)
            pending_features = ver.features[:, : acc + 1]
            result.target_calls += 1
            result.accepted_lengths.append(acc)
            new_tokens = host[2 : 2 + acc] + [bonus]
            if len(result.rounds) < record_rounds:
                result.rounds.append(
                    {
                        "anchor": int(block[0, 0]),
                        "drafted": host[2:],
                        "target": choices[0].tolist() if choices is not None else None,
                        "accepted": acc,
                        "committed": list(new_tokens),
                    }
                )
            stopped = _commit(result.tokens, new_tokens, stops, max_new_tokens)
            t_end = clock.mark()

            clock.add(result, "draft", t, t_draft)
            clock.add(result, "head", t_draft, t_head)
            clock.add(result, "verify", t_head, t_verify)
            clock.add(result, "bookkeeping", t_verify, t_end)
            t = t_end

    result.stopped_on = stopped
    return _finish(result, start, clock)


@torch.inference_mode()
def target_generate(
    target: FrozenTarget,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    timing: bool = False,
) -> GenerationResult:
    """Plain autoregressive decoding with the same wrapper, KV cache and sampling code: the baseline.

    Same arguments and stops as :func:`speculative_generate`. ``accepted_lengths`` is empty and
    ``tau`` is 1.0; the decode steps' target passes are timed under ``verify`` and their sampling and
    commits under ``bookkeeping`` (a step costs ``step_seconds / num_steps``).
    """
    clock = _Clock(target.device, timed=timing)
    start, first = time.perf_counter(), clock.mark()
    prompt = _prompt_tensor(input_ids, target.device)
    stops = _stop_set(target, stop_token_ids)
    result = GenerationResult(tokens=[], prompt_length=prompt.shape[1])
    if max_new_tokens <= 0:
        return _finish(result, start, clock)
    token, _, cache = _prefill(target, prompt, temperature, top_p, generator)
    position = prompt.shape[1]
    result.target_calls = 1
    clock.add(result, "prefill", first, clock.mark())
    stopped = _commit(result.tokens, [int(token[0])], stops, max_new_tokens)
    positions = _positions(0, position + max_new_tokens, prompt.device)  # built once, sliced per step
    t = clock.mark()
    while stopped is None:
        out = target(
            token.view(1, 1),
            position_ids=positions[:, position : position + 1],
            cache=cache,
            use_cache=True,
            return_logits=True,
        )
        t_forward = clock.mark()
        cache = out.cache if out.cache is not None else cache
        position += 1
        token = sample_tokens(out.logits, temperature, top_p, generator)[:, -1]
        result.target_calls += 1
        stopped = _commit(result.tokens, token.tolist(), stops, max_new_tokens)
        t_end = clock.mark()
        clock.add(result, "verify", t, t_forward)
        clock.add(result, "bookkeeping", t_forward, t_end)
        t = t_end
    result.stopped_on = stopped
    return _finish(result, start, clock)
