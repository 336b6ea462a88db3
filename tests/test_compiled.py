"""Selectors through torch.compile: the same drafts as eager mode, every head with weights compiled, and a clear
refusal on a machine that cannot compile (benchmarks compare arms, so compilation must be even-handed)."""

from __future__ import annotations

import pytest
import torch

from lilicorr_pl.decoding.compiled import (
    CompiledSelector,
    check_compile_available,
    check_compile_mode,
    compile_selectors,
    left_cuda_graphs,
    owned,
    uses_cuda_graphs,
)
from lilicorr_pl.heads import DominoHead, DSparkHead, LiLiCorrHead, Top1Selector
from lilicorr_pl.heads.base import SelectContext, Selection
from lilicorr_pl.heads.sampling import DraftSampling
from lilicorr_pl.models.dflash import DraftOutput

H, V, S = 16, 40, 7


def draft_output(seed: int, stride_source: int) -> DraftOutput:
    g = torch.Generator().manual_seed(seed)
    # The anchor feature is a row sliced out of a longer feature table, as in decoding: its size-1 dim's
    # stride depends on the table's length, which changes every round.
    table = torch.randn(1, stride_source, H, generator=g)
    return DraftOutput(slot_hidden=torch.randn(1, S, H, generator=g), slot_logits=torch.randn(1, S, V, generator=g),
                       anchor_feature=table[:, -1], anchor_feature_valid=torch.ones(1, dtype=torch.bool))


def context(sampling: DraftSampling | None = None) -> SelectContext:
    table = torch.randn(V, H, generator=torch.Generator().manual_seed(7))  # the frozen target's embeddings
    return SelectContext(anchor_tokens=torch.tensor([3]), anchor_positions=torch.tensor([9]),
                         embed=lambda ids: table[ids], sampling=sampling)


@pytest.mark.parametrize("head", [
    LiLiCorrHead(top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8),
    DominoHead(gru_hidden=8, rank=4),  # a GRU: traced too (allow_rnn), not split around
    DSparkHead(rank=8),
], ids=["lilicorr", "domino", "dspark"])
def test_compiled_heads_choose_the_drafts_eager_mode_chooses_without_recompiling(head):
    torch.manual_seed(0)
    head.build(H, V, block_size=S + 1, rms_norm_eps=1e-6)
    for p in head.parameters():  # trained-looking weights (zero-initialised layers would hide a wrong graph)
        torch.nn.init.normal_(p, std=0.5)
    head.eval()
    compiled = CompiledSelector(head)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every round
        for round_index in range(4):
            # A new anchor-feature stride every round (the feature table grows) must not mean a new graph.
            draft = draft_output(round_index, stride_source=5 + round_index)
            eager, fast = head.select(draft, context()), compiled.select(draft, context())
            assert torch.equal(eager.tokens, fast.tokens)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert compiled.name == head.name and compiled.top_k == head.top_k


def _small_compiled_head() -> tuple[LiLiCorrHead, CompiledSelector]:
    """A small LiLiCorr head and its compiled wrapper, with Dynamo's caches emptied."""
    head = LiLiCorrHead(top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8)
    head.build(H, V, block_size=S + 1, rms_norm_eps=1e-6).eval()
    torch._dynamo.reset()
    return head, CompiledSelector(head)


def test_sampled_drafts_run_eagerly_with_the_same_generator_stream():
    head, compiled = _small_compiled_head()
    draft = draft_output(1, stride_source=6)
    torch._dynamo.utils.counters.clear()
    picks = []
    for selector in (head, compiled):
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            picks.append(selector.select(draft, context(DraftSampling(temperature=1.0, top_p=1.0, generator=g))))
    assert torch.equal(picks[0].tokens, picks[1].tokens) and torch.equal(picks[0].q, picks[1].q)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing was traced: the eager path ran


def test_only_selectors_with_weights_are_wrapped():
    head = DSparkHead(rank=8)
    head.build(H, V)
    wrapped = compile_selectors({"top1": Top1Selector(), "dspark": head})
    assert isinstance(wrapped["top1"], Top1Selector)  # one argmax: nothing to fuse, only guards to pay
    assert isinstance(wrapped["dspark"], CompiledSelector) and wrapped["dspark"].selector is head


def test_a_machine_that_cannot_compile_is_told_with_the_fix(monkeypatch):
    check_compile_available()  # this machine can (the CI image has a C++ compiler)

    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(RuntimeError, match=r"does not work on this machine \(InvalidCxxCompiler.*install a C\+\+ "
                                           r"compiler \(CPU\) or Triton \(GPU\), or run without --compile"):
        check_compile_available()


def test_a_head_past_the_recompile_limit_fails_instead_of_running_eagerly_under_a_compiled_label():
    head, compiled = _small_compiled_head()
    draft = draft_output(2, stride_source=6)
    try:
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
            assert torch.equal(compiled.select(draft, context(), 4).tokens, head.select(draft, context(), 4).tokens)
            with pytest.raises(RuntimeError, match=r"compiled 'lilicorr' head met more input shapes than torch\."
                                                   r"_dynamo\.config\.recompile_limit \(1\).*without compiling \(--compile false\)"):
                compiled.select(draft, context(), 2)  # a second lattice width: a second graph, past the limit
    finally:
        torch._dynamo.reset()


def test_a_head_the_compiler_fails_on_names_the_fix():
    head = DSparkHead(rank=8)
    head.build(H, V, block_size=S + 1).eval()
    compiled = CompiledSelector(head)

    def failing_backend(graph_module, example_inputs):
        raise NotImplementedError("lowering aten::something")

    compiled._select = torch.compile(head.select, dynamic=False, backend=failing_backend)
    torch._dynamo.reset()
    expected = r"compiling the 'dspark' head failed \(NotImplementedError: lowering aten::something\); run without"
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match=expected):
            compiled.select(draft_output(3, stride_source=6), context())
    finally:
        torch._dynamo.reset()


def test_compile_modes_map_to_cuda_graphs_and_impossible_ones_are_refused_in_one_line():
    assert [uses_cuda_graphs(m) for m in (None, "default", "reduce-overhead", "max-autotune",
                                          "max-autotune-no-cudagraphs")] == [False, False, True, True, False]
    check_compile_mode("default", False, "cpu")
    check_compile_mode("max-autotune-no-cudagraphs", True, "cpu")
    check_compile_mode("reduce-overhead", True, "cuda:1")
    with pytest.raises(ValueError, match=r"'fast' is not a torch.compile mode; use one of default, reduce-overhead"):
        check_compile_mode("fast", True, "cuda")
    with pytest.raises(ValueError, match=r"--compile_mode reduce-overhead sets how the heads are compiled, and they "
                                         r"are not; add --compile true"):
        check_compile_mode("reduce-overhead", False, "cuda")
    with pytest.raises(ValueError, match=r"captures the heads in CUDA graphs, which need a CUDA device \(--device "
                                         r"cuda\); on mps use --compile_mode default"):
        check_compile_mode("max-autotune", True, "mps")


def test_a_cuda_graph_mode_asks_inductor_to_fail_rather_than_leave_a_graph_uncaptured(monkeypatch):
    """torch.compile takes a mode or options: the mode's own options are spelled out, plus cudagraph_or_error, so
    a head Inductor could not capture never runs eagerly under a CUDA-graph label."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    head = DSparkHead(rank=8)
    head.build(H, V, block_size=S + 1)
    for mode in (None, "reduce-overhead", "max-autotune-no-cudagraphs"):
        CompiledSelector(head, mode)._compiled(torch.device("cuda"))  # compiled at the first call, for its device
    assert seen[0] == {"dynamic": False, "options": None}
    assert seen[1]["options"] == {"triton.cudagraphs": True, "triton.cudagraph_or_error": True}
    assert seen[2]["options"] == {"max_autotune": True, "coordinate_descent_tuning": True}  # no CUDA graphs asked
    graphs = CompiledSelector(head, "reduce-overhead")
    assert graphs.cuda_graphs and graphs.mode == "reduce-overhead"
    with pytest.raises(RuntimeError, match=r"compiled with mode 'reduce-overhead', which captures CUDA graphs, and "
                                           r"its inputs are on cpu; compile it with mode 'default' there"):
        graphs.select(draft_output(0, stride_source=6), context())


def test_owned_copies_every_tensor_of_a_selection_out_of_shared_memory():
    """A CUDA graph's outputs are overwritten by its next replay: what a round keeps must be its own copy."""
    head, _ = _small_compiled_head()
    with torch.no_grad():
        selection = head.select(draft_output(4, stride_source=6), context())
    copy = owned(selection)
    assert isinstance(copy, Selection) and copy.q is None
    pairs = [(selection.tokens, copy.tokens), (selection.lattice_index, copy.lattice_index),
             *((getattr(selection.lattice, f), getattr(copy.lattice, f))
               for f in ("candidates", "start", "pair", "candidate_logprobs"))]
    for original, mine in pairs:
        assert torch.equal(original, mine) and mine.data_ptr() != original.data_ptr()
    selection.tokens.zero_()  # the next replay writing over the pool leaves the copy as it was
    assert not torch.equal(copy.tokens, selection.tokens)
    assert owned({"a": [torch.ones(1), (2, None)]})["a"][1] == (2, None)


def test_a_head_that_leaves_its_cuda_graphs_while_running_names_the_fix():
    """Inductor's cudagraph_or_error raises outside compilation too (re-recording past its limit, a mutated input):
    that error becomes one line naming the mode to use; any other error is left as it is."""
    error = RuntimeError("skipping cudagraphs due to mutated inputs (1 instances)\nFound from: ...")
    message = str(left_cuda_graphs("lilicorr", error))
    assert message == ("the 'lilicorr' head left its CUDA graphs (skipping cudagraphs due to mutated inputs (1 "
                       "instances)); run with --compile_mode default (no CUDA graphs)")
    assert left_cuda_graphs("lilicorr", RuntimeError("CUDA out of memory")) is None


def test_cpu_heads_use_inductors_cpp_wrapper_only_where_it_builds(monkeypatch):
    # The C++ wrapper is a Python extension module: a machine without Python's headers cannot build it, and must keep
    # the Python wrapper (the same drafts, slower) rather than fail the benchmark.
    import lilicorr_pl.decoding.compiled as compiled_module

    def probe_with(error: Exception | None):
        def fake_compile(fn, **kwargs):
            assert kwargs["options"] == {"cpp_wrapper": True}  # the probe tries exactly what heads will get
            if error is not None:
                raise error
            return fn
        return fake_compile

    for error, expected in ((None, {"cpp_wrapper": True}), (RuntimeError("fatal error: Python.h: No such file"), {})):
        compiled_module.cpu_wrapper_options.cache_clear()
        monkeypatch.setattr(compiled_module.torch, "compile", probe_with(error))
        assert compiled_module.cpu_wrapper_options() == expected
    compiled_module.cpu_wrapper_options.cache_clear()


def test_a_compiled_head_gets_the_cpu_options_on_a_cpu_and_not_elsewhere(monkeypatch):
    import lilicorr_pl.decoding.compiled as compiled_module

    monkeypatch.setattr(compiled_module, "cpu_wrapper_options", lambda: {"cpp_wrapper": True})
    seen = []

    def recording_compile(fn, **kwargs):
        seen.append(kwargs["options"])
        return fn  # eager: only the options are under test here

    monkeypatch.setattr(compiled_module.torch, "compile", recording_compile)
    head, compiled = _small_compiled_head()
    compiled.select(draft_output(0, stride_source=5), context())
    compiled.select(draft_output(1, stride_source=6), context())
    assert seen == [{"cpp_wrapper": True}]  # compiled once, at the first call, for the device it ran on
    CompiledSelector(head, "max-autotune-no-cudagraphs")._compiled(torch.device("cpu"))
    assert seen[1] == {"max_autotune": True, "coordinate_descent_tuning": True, "cpp_wrapper": True}
    CompiledSelector(head)._compiled(torch.device("cuda"))
    assert seen[2] is None  # another device: the mode's own options only


def test_the_wrapper_a_compiled_head_ran_with_is_recorded(monkeypatch):
    # The results JSON says which Inductor wrapper called the heads' kernels: the C++ one is faster on a CPU with the
    # same drafts, so two runs' head timings are only comparable knowing it.
    import lilicorr_pl.decoding.compiled as compiled_module
    from lilicorr_pl.decoding.compiled import compiled_wrappers
    from lilicorr_pl.heads.top1 import Top1Selector

    monkeypatch.setattr(compiled_module.torch, "compile", lambda fn, **kwargs: fn)
    head, cpp = _small_compiled_head()
    assert cpp.wrapper is None and compiled_wrappers([cpp, Top1Selector()]) is None  # not compiled until it runs
    monkeypatch.setattr(compiled_module, "cpu_wrapper_options", lambda: {"cpp_wrapper": True})
    cpp.select(draft_output(0, stride_source=5), context())
    assert cpp.wrapper == "cpp" and compiled_wrappers([cpp, Top1Selector()]) == "cpp"
    monkeypatch.setattr(compiled_module, "cpu_wrapper_options", lambda: {})  # a machine without Python's headers
    python = CompiledSelector(head)
    python.select(draft_output(0, stride_source=5), context())
    assert python.wrapper == "python" and compiled_wrappers([python, cpp]) == "cpp+python"
    gpu = CompiledSelector(head)
    gpu._compiled(torch.device("cuda"))
    assert gpu.wrapper == "python"  # no C++ wrapper asked for off the CPU
