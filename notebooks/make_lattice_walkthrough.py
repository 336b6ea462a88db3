"""Writes ``notebooks/lattice_walkthrough.ipynb`` ("Walking one drafted lattice") from the cells below.

The notebook is generated so that its source is reviewable as plain Python and is committed without
outputs; ``tests/test_notebooks.py`` regenerates it and fails if the committed file drifted.

    python notebooks/make_lattice_walkthrough.py            # rewrite the notebook
    python notebooks/make_lattice_walkthrough.py --check    # exit 1 if the committed notebook is stale
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOK = Path(__file__).with_name("lattice_walkthrough.ipynb")

# (kind, id, tags, source). Ids are fixed so regenerating gives byte-identical JSON; tags let the
# test find the cells whose output it checks.
CELLS: list[tuple[str, str, list[str], str]] = [
    ("markdown", "intro", [], r"""
        # Walking one drafted lattice

        This notebook follows **one** speculative-decoding round of a trained DFlash + LiLiCorr drafter
        slowly, printing every intermediate:

        1. load a trained system (frozen target, DFlash drafter, head) from a checkpoint;
        2. prefill the target on one benchmark prompt, take its greedy next token as the **anchor**, and let
           the drafter propose the block `[anchor, MASK × S]` in one forward pass;
        3. look at the **lattice**: the drafter's top-K candidates per slot, the head's start and pair scores,
           and the greedy walk through them;
        4. **verify** both the drafter's per-slot top-1 block and the LiLiCorr block with one target pass each,
           and count how many drafts the target accepts;
        5. zoom out to whole benchmarks with the per-position acceptance curves of `lilicorr demo`.

        τ (acceptance length) is always reported **including the target's bonus token**: τ = accepted + 1.

        The defaults read what `lilicorr demo` (or `lilicorr demo --quick`) wrote last when run from the repository
        root: the newest `runs/demo/results*.json` (`results.json`, or `results-quick.json` from `--quick`) and the
        LiLiCorr checkpoint of the same run, which that file names; point the two environment variables of the next
        cell at any other `lilicorr fit` checkpoint or results file (a glob picks its newest match).
        """),
    ("code", "parameters", ["parameters"], r"""
        import os

        CKPT = os.environ.get("LILICORR_NOTEBOOK_CKPT")  # None: the LiLiCorr checkpoint of the results file below
        RESULTS = os.environ.get("LILICORR_NOTEBOOK_RESULTS", "runs/demo/results*.json")
        PROMPT_INDEX = 0
        BENCHMARK = "stdlib-heldout"  # or "humaneval"; prompts stay raw code (the demo target is a code LM)
        """),
    ("code", "setup", [], r"""
        import glob
        import io
        import json
        import warnings
        from pathlib import Path

        import matplotlib.pyplot as plt
        import torch
        from IPython.display import Image, display
        from transformers.utils import logging as hf_logging

        from lilicorr_pl.decoding.benchmarks import load_prompts
        from lilicorr_pl.decoding.speculative import greedy_accept, speculative_generate
        from lilicorr_pl.heads import LiLiCorrHead, SelectContext, Top1Selector
        from lilicorr_pl.system import DraftSystem
        from lilicorr_pl.target import FrozenTarget

        hf_logging.disable_progress_bar()
        # Lightning notes that the drafter and head modules are also hyperparameters; harmless here.
        warnings.filterwarnings("ignore", message=r".*is an instance of `nn.Module`.*")


        def find(path: str) -> Path | None:
            # As given (relative to the working directory), else relative to the repository root: Jupyter starts
            # this notebook in notebooks/, the demo writes runs/ at the root. A glob: its newest match (the demo
            # keys its checkpoints by stage, and a rerun with other settings trains a new one).
            bases = (Path.cwd(), Path.cwd().parent)
            for base in bases:  # a literal name first, `[` and all
                if (base / path).is_file():
                    return base / path
            for base in bases:  # the folder itself is no pattern, whatever its name holds
                found = [base / p for p in glob.glob(path, root_dir=base) if (base / p).is_file()]
                if found:
                    return max(found, key=lambda p: p.stat().st_mtime)
            return None


        def run_checkpoint(results_path: Path | None) -> Path | None:
            # The checkpoint of the run whose results section 5 shows: `lilicorr demo` names each arm's in its results
            # file (the LiLiCorr arm's, else the first arm's). Looked for where it was written, then in the results
            # file's own folder (a workdir moved or copied elsewhere). None for a results file without that entry
            # (written by an older version) or whose checkpoint is gone.
            if results_path is None:
                return None
            try:
                named = json.loads(results_path.read_text()).get("checkpoints") or {}
            except (OSError, ValueError, AttributeError):  # not a results file: section 5 says so
                return None
            arm = "lilicorr" if "lilicorr" in named else next(iter(named), None)
            if arm is None:
                return None
            recorded = Path(named[arm])
            for path in (recorded, results_path.parent / "checkpoints" / recorded.name):
                if path.is_file():
                    return path
            return None


        def show_figure(fig) -> None:
            # Embed as PNG whatever the matplotlib backend (inline in Jupyter, Agg in tests and CI).
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
            plt.close(fig)
            display(Image(buffer.getvalue()))
        """),
    ("markdown", "load-md", [], r"""
        ## 1. Load the trained system

        A checkpoint holds the drafter and the head only. The frozen target is *configuration*: its name and
        layer ids are in the checkpoint's hyperparameters, and `configure_model()` loads its weights
        (a `builtin:` target was resolved to its built, cached directory when the training run started).
        """),
    ("code", "load", ["load"], r"""
        results_path = find(RESULTS)
        if CKPT:
            ckpt_path = find(CKPT)
        else:  # the run's own checkpoint; for an older results file, the newest a demo wrote
            ckpt_path = run_checkpoint(results_path)
            if ckpt_path is None:
                ckpt_path = find("runs/demo/checkpoints/lilicorr-*.ckpt")
                if ckpt_path is not None and results_path is not None:
                    print(f"note: {results_path.name} names no checkpoint that is still there; using the newest demo "
                          f"checkpoint, {ckpt_path.name}, which may come from another run than section 5's results")
        if ckpt_path is None:
            raise FileNotFoundError(
                f"no checkpoint at {CKPT or 'runs/demo/checkpoints/lilicorr-*.ckpt'!r}; run `lilicorr demo --quick` "
                "from the repository root (it writes runs/demo/checkpoints/lilicorr-<stage key>.ckpt) or set "
                "LILICORR_NOTEBOOK_CKPT to a `lilicorr fit` checkpoint"
            )
        print(f"checkpoint: {ckpt_path.name}" + (f"  (results: {results_path.name})" if results_path else ""))
        system = DraftSystem.from_checkpoint(ckpt_path, map_location="cpu")
        system.configure_model()  # loads the frozen target named in the hyperparameters
        system.eval()
        target, drafter, head = system.target, system.drafter, system.head
        tokenizer = target.tokenizer
        has_lattice = isinstance(head, LiLiCorrHead)  # the start/pair scores below are LiLiCorr's
        S = drafter.num_slots  # speculative slots per block (block size minus the anchor slot)


        def count(module: torch.nn.Module) -> int:
            return sum(p.numel() for p in module.parameters())


        print(f"target : {count(target):>10,} parameters, {target.num_layers} layers, hidden {target.hidden_size}, "
              f"{target.vocab_rows} vocabulary rows")
        print(f"drafter: {count(drafter):>10,} parameters, {drafter.num_layers} layers, block {drafter.block_size} "
              f"(anchor + {S} speculative slots), context features from target layers {drafter.target_layer_ids}")
        print(f"head   : {count(head):>10,} parameters, {type(head).__name__}"
              + (f", lattice width K = {head.top_k}" if has_lattice else ""))
        if not has_lattice:
            print(f"\n{type(head).__name__} builds no lattice (it is not a LiLiCorrHead), so there are no start/pair "
                  "scores to show: the walkthrough below shows the drafter's per-slot top-1 block only.")
        """),
    ("markdown", "draft-md", [], r"""
        ## 2. Draft one block

        * **Prefill.** The target reads the prompt once. It returns the context features (raw outputs of the
          drafter's target layers) for every prompt token, the logits of the next token and a KV cache.
        * **Anchor.** The target's greedy next token. It is already committed: the drafter only guesses what
          comes *after* it.
        * **Draft.** One drafter pass over `[anchor, MASK × S]`, attending to the fused prompt features, gives
          independent per-slot logits (`slot_logits [1, S, V]`).
        * **Select.** Vanilla DFlash takes the per-slot argmax (top-1). The LiLiCorr head keeps the top-K
          candidates per slot, scores every adjacent pair of candidates, and walks the lattice greedily.
        """),
    ("code", "draft", ["draft"], r"""
        prompts = load_prompts(BENCHMARK, tokenizer, PROMPT_INDEX + 1, chat_template=False)
        prompt = torch.tensor([prompts.input_ids[PROMPT_INDEX]])  # [1, P]
        P = prompt.shape[1]


        def show(token_id) -> str:
            return repr(tokenizer.decode([int(token_id)]))


        with torch.no_grad():
            prefill = target(prompt, position_ids=torch.arange(P).unsqueeze(0), use_cache=True, return_logits=True)
            anchor = prefill.logits[:, -1].argmax(-1)  # [1]: the target's greedy next token
            draft = drafter.draft(drafter.new_cache(), prefill.features, anchor, target.embed, target.lm_head)
            top1 = draft.slot_logits.argmax(-1)[0]  # [S]: vanilla DFlash's block
            top1_prob = draft.slot_logits.float().softmax(-1).amax(-1)[0]  # [S]
            if has_lattice:
                # The selector sees the drafter's outputs and where the block starts: anchor token and position.
                selection = head.select(draft, SelectContext(anchor, torch.tensor([P]), target.embed))
                lattice = selection.lattice  # candidates [1, S, K], start [1, K], pair [1, S-1, K, K]
                walk_rank = selection.lattice_index[0]  # [S]: chosen candidate rank per slot (0 = top-1)
                walk = selection.tokens[0]  # [S]: LiLiCorr's block

        print(f"prompt {PROMPT_INDEX} of {BENCHMARK!r} ({P} tokens):")
        print(prompts.texts[PROMPT_INDEX])
        print(f"\nanchor (the target's greedy next token): {show(anchor)}")
        print(f"prompt features {tuple(prefill.features.shape)} -> slot logits {tuple(draft.slot_logits.shape)}")
        if has_lattice:
            print(f"lattice: candidates {tuple(lattice.candidates.shape)}, start {tuple(lattice.start.shape)}, "
                  f"pair {tuple(lattice.pair.shape)}")
        """),
    ("markdown", "lattice-md", [], r"""
        ## 3. The lattice

        Rows are the speculative slots `1..S`, columns the drafter's candidates in rank order (rank 0 is the
        drafter's top-1), each with its drafter probability. `*` marks the greedy walk's pick:
        `j_1 = argmax start`, then `j_{s+1} = argmax pair[s, j_s, :]`, reading only the row of the candidate it
        just picked. Where the walk leaves rank 0, the head overrides the drafter's independent marginal because
        that candidate fits its neighbours better.
        """),
    ("code", "lattice-table", ["lattice-table"], r"""
        def short(token_id, width: int = 10) -> str:
            text = show(token_id)
            return text if len(text) <= width else text[: width - 1] + "…"


        if has_lattice:
            K = lattice.top_k
            candidates = lattice.candidates[0]  # [S, K]
            probs = lattice.candidate_logprobs[0].exp()  # [S, K]
            width = 17
            print("slot | " + " | ".join(f"rank {r}".ljust(width) for r in range(K)) + " | greedy walk")
            for s in range(S):
                marks = ["*" if r == int(walk_rank[s]) else " " for r in range(K)]
                cells = [f"{marks[r]}{short(candidates[s, r])} {probs[s, r]:.2f}".ljust(width) for r in range(K)]
                pick = "top-1" if int(walk_rank[s]) == 0 else f"rank {int(walk_rank[s])}, overrides top-1"
                print(f"{s + 1:>4} | " + " | ".join(cells) + f" | {pick}")
            overridden = int((walk_rank != 0).sum())
            print(f"\n* = greedy walk. It keeps the drafter's top-1 at {S - overridden} of {S} slots and overrides it at "
                  f"{overridden}.")
            starts = ", ".join(f"{short(c)} {v:+.2f}" for c, v in zip(candidates[0], lattice.start[0]))
            print(f"start scores (slot 1): {starts}")
            print(f"scores are σ·cosine with σ = {head.scale:g}, so they lie in [-{head.scale:g}, {head.scale:g}]")
        else:
            print("slot | top-1 token | drafter prob")
            for s in range(S):
                print(f"{s + 1:>4} | {short(top1[s]):<11} | {top1_prob[s]:.2f}")
        """),
    ("markdown", "scores-md", [], r"""
        The scores behind the walk: the start scores of the slot-1 candidates, and the `K × K` pair scores
        `pair[s, i, j]` from candidate `i` at slot `s` to candidate `j` at slot `s + 1` for the first slot pairs.
        The walk reads one row per pair matrix (outlined) and takes its argmax (circled).
        """),
    ("code", "scores", ["scores"], r"""
        if has_lattice:
            from matplotlib.patches import Rectangle

            num_pairs = min(3, S - 1)
            sigma = head.scale
            fig, axes = plt.subplots(1, num_pairs + 1, figsize=(1.5 + 3.6 * (num_pairs + 1), 3.6),
                                     gridspec_kw={"width_ratios": [1] + [K] * num_pairs, "wspace": 0.45}, squeeze=False)
            axes = axes[0]
            labels = [[short(c, 8) for c in candidates[s]] for s in range(S)]

            def heat(ax, scores, rows, cols, title):
                image = ax.imshow(scores, cmap="RdBu_r", vmin=-sigma, vmax=sigma)
                ax.set_title(title, fontsize=9)
                ax.set_yticks(range(len(rows)), rows, fontsize=7)
                ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=60)
                for i in range(scores.shape[0]):
                    for j in range(scores.shape[1]):
                        ax.text(j, i, f"{float(scores[i, j]):.1f}", ha="center", va="center", fontsize=6)
                return image

            start = lattice.start[0].view(K, 1)  # [K, 1]: one column, the candidates of slot 1
            image = heat(axes[0], start, labels[0], ["start"], "start → slot 1")
            axes[0].add_patch(Rectangle((-0.5, int(walk_rank[0]) - 0.5), 1, 1, fill=False, lw=2))
            for s in range(num_pairs):
                ax = axes[s + 1]
                heat(ax, lattice.pair[0, s], labels[s], labels[s + 1], f"pair: slot {s + 1} → slot {s + 2}")
                row, col = int(walk_rank[s]), int(walk_rank[s + 1])
                ax.add_patch(Rectangle((-0.5, row - 0.5), K, 1, fill=False, lw=1.5))
                ax.plot(col, row, "o", mfc="none", mec="black", ms=14, mew=1.5)
                ax.set_ylabel(f"slot {s + 1} candidate", fontsize=8)
                ax.set_xlabel(f"slot {s + 2} candidate", fontsize=8)
            fig.colorbar(image, ax=list(axes), shrink=0.8, label="score (σ·cos)")
            show_figure(fig)
        else:
            print("no lattice scores: the checkpoint's head is not a LiLiCorrHead")
        """),
    ("markdown", "verify-md", [], r"""
        ## 4. Verify against the target

        One target pass over `[anchor, d_1..d_S]`, on top of the prompt's KV cache, gives the target's own choice
        `y_k` after every block token (greedy here, T = 0). The round accepts the longest prefix with
        `d_{k+1} == y_k`; the target's choice at the first mismatch (or after the last draft) is the **bonus
        token**, committed for free. So τ for the round = accepted + 1. After each verify the cache is cropped back
        to the prompt, as the decoding loop does with a rejected tail, so both blocks see the same context.
        """),
    ("code", "verify", ["verify"], r"""
        def verify(drafts: torch.Tensor) -> tuple[torch.Tensor, int]:
            # One target pass over [anchor, d_1..d_S] -> (target choices y_0..y_S, accepted drafts).
            block = torch.cat([anchor.view(1, 1), drafts.view(1, S)], dim=1)  # [1, S+1]
            with torch.no_grad():
                out = target(block, position_ids=torch.arange(P, P + S + 1).unsqueeze(0), cache=prefill.cache,
                             use_cache=True, return_logits=True)
            FrozenTarget.crop_cache(out.cache if out.cache is not None else prefill.cache, P)
            choices = out.logits.argmax(-1)  # [1, S+1]
            accepted, _bonus = greedy_accept(drafts.view(1, S), choices)
            return choices[0], int(accepted[0])


        blocks = {"top-1": top1}
        if has_lattice:
            blocks["LiLiCorr walk"] = walk
        tau = {}
        for name, drafts in blocks.items():
            choices, accepted = verify(drafts)
            tau[name] = accepted + 1
            print(f"── {name} ──")
            print("   k | drafted d_k  | target y_k-1 | ")
            for k in range(S):
                verdict = "accepted" if k < accepted else ("rejected" if k == accepted else "(not reached)")
                print(f"{k + 1:>4} | {short(drafts[k], 12):<12} | {short(choices[k], 12):<12} | {verdict}")
            print(f"bonus token y_{accepted} = {show(choices[accepted])}")
            print(f"{name}: accepted {accepted} of {S} drafts -> τ = {accepted} + 1 = {tau[name]} "
                  "(bonus token included)\n")

        # The same round through the library's decoding loop: it must draft and accept exactly the same.
        selector = head if has_lattice else Top1Selector()
        result = speculative_generate(target, drafter, selector, prompt, max_new_tokens=S + 1, stop_token_ids=[],
                                      record_rounds=1)
        first = result.rounds[0]
        chosen = "LiLiCorr walk" if has_lattice else "top-1"
        assert first["drafted"] == blocks[chosen].tolist() and first["accepted"] + 1 == tau[chosen], (first, tau)
        print(f"speculative_generate's first round drafts the same {chosen} block and accepts {first['accepted']}: "
              "it agrees with this walkthrough")
        """),
    ("markdown", "results-md", [], r"""
        ## 5. Across whole benchmarks

        One round is an anecdote. `lilicorr demo` trains every arm on the same data and measures real speculative
        decoding on HumanEval prompts and held-out stdlib prefixes. The curves show the per-position conditional
        acceptance `P(draft k accepted | drafts 1..k-1 accepted)`; the dashed `oracle` is the top-K lattice bound
        (the best any chain reranker could do with the same drafter).
        """),
    ("code", "results", ["results"], r"""
        if results_path is None:
            print(f"No results file at {RESULTS!r}. Produce one with `lilicorr demo --quick` from the repository "
                  "root (a few minutes on a laptop CPU; it writes runs/demo/results-quick.json), or set "
                  "LILICORR_NOTEBOOK_RESULTS to a results.json.")
        else:
            rows = json.loads(results_path.read_text())["results"]
            benchmarks = sorted({r["benchmark"] for r in rows})
            arm_names = list(dict.fromkeys(r["arm"] for r in rows))
            colors = {arm: f"C{i}" for i, arm in enumerate(arm_names)}  # one colour per arm in every panel
            fig, axes = plt.subplots(1, len(benchmarks), figsize=(4.6 * len(benchmarks), 3.6), squeeze=False)
            for ax, bench in zip(axes[0], benchmarks):
                for r in rows:
                    if r["benchmark"] != bench:
                        continue
                    curve = r["per_position_acceptance"]
                    style = "--" if r["arm"] == "oracle" else ("-" if float(r["temperature"]) == 0 else ":")
                    ax.plot(range(1, len(curve) + 1), curve, style, color=colors[r["arm"]], marker="o", ms=3,
                            label=f"{r['arm']} T={float(r['temperature']):g} τ={r['tau']:.2f}")
                ax.set(title=bench, xlabel="draft position k", ylim=(0, 1.02))
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            axes[0][0].set_ylabel("P(accept k | reached k)")
            fig.tight_layout()
            show_figure(fig)

            taus = {(r["benchmark"], float(r["temperature"]), r["arm"]): r["tau"] for r in rows}
            print("τ per verify round, bonus token included")
            print(f"{'benchmark':<16} {'T':>4} " + " ".join(f"{a:>24}" for a in arm_names))
            for bench, temp in sorted({(b, t) for b, t, _ in taus}):
                cells = [f"{taus[bench, temp, a]:>24.2f}" if (bench, temp, a) in taus else f"{'-':>24}"
                         for a in arm_names]
                print(f"{bench:<16} {temp:>4g} " + " ".join(cells))
        """),
    ("markdown", "outro", [], r"""
        ## What to look for

        * Slots where the walk leaves rank 0 are where the drafter's independent per-slot marginals disagree with
          each other; a good head overrides them only when the target agrees (compare the two verify tables).
        * A pair matrix with nearly equal scores everywhere means the head has collapsed (training logs this as
          `logfactor_spread`, the reference's signal, and `logfactor_row_spread`, which reads each row alone: rows
          that each hold one score leave the walk nothing to choose, however much they differ); a trained head has
          sharp rows.
        * Change `PROMPT_INDEX` (or `BENCHMARK`) and re-run from section 2 to walk another lattice.
        """),
]


def build_notebook() -> nbformat.NotebookNode:
    """The notebook, without outputs, with fixed cell ids (deterministic JSON)."""
    cells = []
    for kind, cell_id, tags, source in CELLS:
        text = textwrap.dedent(source).strip("\n")
        metadata = {"tags": list(tags)} if tags else {}
        make = new_markdown_cell if kind == "markdown" else new_code_cell
        cells.append(make(text, id=cell_id, metadata=metadata))
    nb = new_notebook(
        cells=cells,
        metadata={
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
    )
    nbformat.validate(nb)
    return nb


def render() -> str:
    """The notebook file's exact text."""
    return nbformat.writes(build_notebook())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=NOTEBOOK, help="where to write the notebook")
    parser.add_argument("--check", action="store_true", help="only compare with --output; exit 1 if it differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
        if current != text:
            print(f"{args.output} is stale; run: python notebooks/make_lattice_walkthrough.py", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
