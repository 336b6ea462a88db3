"""Selectors run through ``torch.compile``: what the serving engines' CUDA graphs do for a head, on any device.

A head's ``select`` is a few hundred small ops per round (the LiLiCorr head ≈ 170 on the demo's sizes), so in
eager mode its cost is mostly per-op dispatch, not arithmetic. The engines capture drafter and head in CUDA
graphs; :class:`CompiledSelector` is the portable stand-in: the same ``select``, traced once per shape and
fused by Inductor, token for token the same drafts (tested). A benchmark that compiles one arm's head must
compile every arm's head (``lilicorr bench --compile``, ``lilicorr demo --compile``), or the comparison favours it.

On CUDA, ``mode="reduce-overhead"`` (or ``"max-autotune"``) also captures the fused graph in a CUDA graph, so a
round's head is one replay instead of a launch per kernel: what the engines do. A graph Inductor cannot capture
is an error there, not a silent eager fallback, and every selection is copied out of the graphs' memory pool
(the next replay overwrites it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, get_args

import torch
from torch import nn

from lilicorr_pl.checkpoint import first_line
from lilicorr_pl.heads.base import SelectContext, Selection
from lilicorr_pl.target import CompileModeName

__all__ = ["COMPILE_MODES", "CompiledSelector", "check_compile_available", "check_compile_mode", "compile_selectors",
           "compiled_wrappers", "uses_cuda_graphs"]

COMPILE_MODES: tuple[str, ...] = get_args(CompileModeName)
"""``torch.compile``'s modes, as ``--compile_mode`` takes them."""


def uses_cuda_graphs(mode: str | None) -> bool:
    """Whether ``torch.compile(mode=mode)`` captures CUDA graphs (Inductor's ``triton.cudagraphs``)."""
    return mode not in (None, "default") and bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs"))


def check_compile_mode(mode: str, compile: bool, device: str | torch.device) -> None:
    """Refuse, in one line and before anything is built, a ``--compile_mode`` that cannot apply: one torch does not
    know, one given without ``--compile true``, or a CUDA-graph mode on a device without CUDA graphs."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile_mode {mode!r} is not a torch.compile mode; use one of {', '.join(COMPILE_MODES)}")
    if mode != "default" and not compile:
        raise ValueError(f"--compile_mode {mode} sets how the heads are compiled, and they are not; add --compile true")
    if uses_cuda_graphs(mode) and torch.device(device).type != "cuda":
        raise ValueError(f"--compile_mode {mode} captures the heads in CUDA graphs, which need a CUDA device "
                         f"(--device cuda); on {device} use --compile_mode default")


# Past Dynamo's recompile limit a compiled function silently runs eagerly; torch >= 2.7 can raise instead (older
# versions keep the silent fallback: nothing to catch there).
_LOUD_RECOMPILE_LIMIT = {"fail_on_recompile_limit_hit": True} if hasattr(
    torch._dynamo.config, "fail_on_recompile_limit_hit") else {}
_RecompileLimitHit: type[BaseException] = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None) or type(
    "_NeverRaised", (Exception,), {})


def _dense(x: Any) -> Any:
    # Dynamo specialises on strides, and a size-1 dim's stride varies with the tensor it was sliced from
    # (the drafter's anchor feature): a dense copy of such a view keeps every round on one graph.
    if not isinstance(x, torch.Tensor):
        return x
    expected, step = [], 1
    for size in reversed(x.shape):
        expected.append(step)
        step *= size
    return x if x.stride() == tuple(reversed(expected)) else x.clone(memory_format=torch.contiguous_format)


class CompiledSelector(nn.Module):
    """``selector.select`` through ``torch.compile`` for deterministic drafts (T = 0, and the point-mass rule at
    T > 0); sampled drafts run the selector as it is. Static shapes: one graph per lattice width.

    Holds the original selector as a submodule, so eval/train mode, devices and state dicts are its own.
    RNN layers (Domino's GRU) are traced too (``allow_rnn``), so no head is left half-compiled.

    ``mode``: ``torch.compile``'s (None = ``"default"``). A CUDA-graph mode (``"reduce-overhead"``,
    ``"max-autotune"``) runs on CUDA only; a graph Inductor would leave uncaptured raises instead
    (``triton.cudagraph_or_error``), and each selection is returned as tensors of its own.
    """

    def __init__(self, selector: nn.Module, mode: str | None = None) -> None:
        super().__init__()
        self.selector = selector
        self.mode = mode or "default"
        self.cuda_graphs = uses_cuda_graphs(self.mode)
        options = dict(torch._inductor.list_mode_options(self.mode))
        if self.cuda_graphs and hasattr(torch._inductor.config.triton, "cudagraph_or_error"):
            options["triton.cudagraph_or_error"] = True  # an uncaptured graph fails rather than runs eagerly
        self._options = options
        # Compiled at the first call, with the options of the device the head runs on (cpu_wrapper_options).
        self._select: Any = None
        self.wrapper: str | None = None
        """Inductor's wrapper that calls the head's kernels, ``"cpp"`` or ``"python"``, once compiled (None before):
        the results JSON records it, since the C++ one makes a CPU head faster with the same drafts."""

    def _compiled(self, device: torch.device) -> Any:
        if self._select is None:
            options = {**self._options, **(cpu_wrapper_options() if device.type == "cpu" else {})}
            # torch.compile takes a mode or options, not both: the mode's own options, spelled out.
            self._select = torch.compile(self.selector.select, dynamic=False, options=options or None)
            # Asked for here, or switched on for the whole process (TORCHINDUCTOR_CPP_WRAPPER=1).
            cpp = options.get("cpp_wrapper", getattr(torch._inductor.config, "cpp_wrapper", False))
            self.wrapper = "cpp" if cpp else "python"
        return self._select

    @property
    def name(self) -> str:
        return self.selector.name

    @property
    def top_k(self) -> int:
        return self.selector.top_k

    def select(self, draft: Any, context: SelectContext, *args: Any) -> Selection:
        if context.sampling is not None:
            # Sampled drafts draw from a torch.Generator, which the compiler cannot trace: the graph would break
            # around every draw and the pieces cost more than eager mode (measured), so that path stays eager.
            return self.selector.select(draft, context, *args)
        draft = dataclasses.replace(draft, **{f.name: _dense(getattr(draft, f.name)) for f in dataclasses.fields(draft)})
        context = dataclasses.replace(context, anchor_tokens=_dense(context.anchor_tokens),
                                      anchor_positions=_dense(context.anchor_positions))
        if self.cuda_graphs:
            if not draft.slot_logits.is_cuda:
                raise RuntimeError(f"the {self.name!r} head is compiled with mode {self.mode!r}, which captures CUDA "
                                   f"graphs, and its inputs are on {draft.slot_logits.device}; compile it with mode "
                                   "'default' there")
            torch.compiler.cudagraph_mark_step_begin()  # a new round: the previous replay's outputs may be reused
        # Past Dynamo's recompile limit (8 shapes per code object; instances of one head class share their graphs)
        # it would run the head eagerly without a word, and the row would still say compiled: fail instead.
        try:
            with torch._dynamo.config.patch(allow_rnn=True, **_LOUD_RECOMPILE_LIMIT):
                selection = self._compiled(draft.slot_logits.device)(draft, context, *args)
        except torch._dynamo.exc.BackendCompilerFailed as error:  # a head Inductor cannot compile, after training
            inner = getattr(error, "inner_exception", None) or error
            first = first_line(inner, with_type=True)
            fix = ("run with --compile_mode default (no CUDA graphs)" if self.cuda_graphs else
                   "run without --compile (lilicorr demo --compile false reuses every trained stage)")
            raise RuntimeError(f"compiling the {self.name!r} head failed ({first}); {fix}") from error
        except _RecompileLimitHit as error:
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            raise RuntimeError(
                f"the compiled {self.name!r} head met more input shapes than torch._dynamo.config.recompile_limit "
                f"({limit}) allows, so it would silently run eagerly; benchmark fewer lattice widths or block sizes "
                "in one process, or run without compiling (--compile false)"
            ) from error
        except RuntimeError as error:  # a graph given up on while replaying (re-recording past the limit, a mutation)
            left = left_cuda_graphs(self.name, error) if self.cuda_graphs else None
            if left is None:
                raise
            raise left from error
        # A CUDA graph's outputs live in its memory pool, which the next round's replay overwrites.
        return owned(selection) if self.cuda_graphs else selection


def left_cuda_graphs(name: str, error: BaseException) -> RuntimeError | None:
    """The one-line error for a head whose CUDA graphs Inductor gave up on while it ran (``cudagraph_or_error``
    raises ``skipping cudagraphs due to …`` there, outside compilation), or None for any other error."""
    text = str(error).strip()
    if not text.startswith("skipping cudagraph"):
        return None
    return RuntimeError(f"the {name!r} head left its CUDA graphs ({text.splitlines()[0]}); run with --compile_mode "
                        "default (no CUDA graphs)")


def owned(value: Any) -> Any:
    """``value`` with every tensor in it (inside dataclasses, tuples, lists and dicts) copied to memory of its own."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: owned(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (list, tuple)):
        return type(value)(owned(v) for v in value)
    if isinstance(value, dict):
        return {k: owned(v) for k, v in value.items()}
    return value


def _compile_one_op(device: str | torch.device, options: dict[str, Any] | None = None) -> None:
    """Compile and run a one-op function on ``device`` with Inductor ``options``: whether this machine can build it."""
    torch.compile(lambda x: x * 2 + 1, dynamic=False, options=options)(torch.ones(2, device=device))


def check_compile_available(device: str | torch.device = "cpu", fix: str = "run without --compile") -> None:
    """Compile and run a one-op function on ``device``, so a machine without Inductor's toolchain (a C++
    compiler on CPU, Triton on GPU) is told up front, with the fix, instead of failing mid-benchmark."""
    try:
        _compile_one_op(device)
    except Exception as error:  # noqa: BLE001 - any backend failure means: not on this machine
        raise RuntimeError(
            f"torch.compile does not work on this machine ({first_line(error)}); install a C++ compiler (CPU) or Triton "
            f"(GPU), or {fix}"
        ) from error


@functools.lru_cache(maxsize=None)
def cpu_wrapper_options() -> dict[str, bool]:
    """Inductor options for heads compiled on a CPU: ``cpp_wrapper``, where it works on this machine, else none.

    A head is a few dozen small kernels per round, and on a CPU the default Python wrapper that calls them is a sixth
    of the compiled head's time (the LiLiCorr head at the demo's sizes, side by side on one core: 1.35 -> 1.11 ms a
    call, the same drafts). The C++ wrapper is a Python extension module, so it also needs Python's headers; a
    machine without them keeps the Python wrapper (slower, the same drafts) instead of failing. Probed once per
    process."""
    if not hasattr(torch._inductor.config, "cpp_wrapper"):
        return {}
    try:
        _compile_one_op("cpu", {"cpp_wrapper": True})
    except Exception:  # noqa: BLE001 - any failure: this machine cannot build it; the Python wrapper still works
        return {}
    return {"cpp_wrapper": True}


def compiled_wrappers(selectors: Iterable[Any]) -> str | None:
    """The Inductor wrapper (``"cpp"``, ``"python"``) of the compiled heads among ``selectors`` that ran, joined with
    ``+`` if they differ; None where none was compiled or none ran."""
    found = sorted({s.wrapper for s in selectors if isinstance(s, CompiledSelector) and s.wrapper is not None})
    return "+".join(found) or None


def compile_selectors(selectors: dict[str, Any], mode: str | None = None) -> dict[str, Any]:
    """Every selector with weights wrapped in :class:`CompiledSelector` (with ``mode``); a parameter-free one
    (top-1: one argmax) has nothing to fuse and would only pay the wrapper's guards, so it stays as it is."""
    return {name: s if s.parameter_free else CompiledSelector(s, mode) for name, s in selectors.items()}
