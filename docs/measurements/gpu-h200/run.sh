#!/bin/bash
# The GPU measurements of docs/measurements/gpu-h200, in one script (run from the repository root on a CUDA machine
# with the project installed):
#   bash docs/measurements/gpu-h200/run.sh TARGET_DIR LILICORR_CKPT DFLASH_CKPT OUT_DIR
# TARGET_DIR: the demo's target (`lilicorr build-target --preset full`, or the folder a demo run's results name);
# the checkpoints: the demo's LiLiCorr and DFlash arms (its results JSON names them under "checkpoints").
# The stdlib prompts are the 40 held-out prefixes the demo benchmarks (seed 1, 64 tokens), written out by
#   python -c "..." below, so a machine with another Python's standard library decodes the same prompts.
set -u
TARGET=$1 LILICORR=$2 DFLASH=$3 OUT=$4
mkdir -p "$OUT"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
PROMPTS=docs/measurements/gpu-h200/stdlib-heldout-demo.jsonl
LC="python -m lilicorr_pl"

python -m pytest tests/gpu -q -p no:cacheprovider

$LC perf --round_timing true -c configs/demo/base.yaml -c configs/demo/arms/lilicorr.yaml \
  --model.target.name_or_path="$TARGET" --device cuda --json "$OUT/round-timing-demo-shape.json"
$LC perf --round_timing true -c configs/qwen3-8b/base.yaml -c configs/qwen3-8b/lilicorr.yaml \
  --target_config configs/qwen3-8b/Qwen3-8B.config.json --context 2048 --device cuda --json "$OUT/round-timing-qwen3-8b-run1.json"
# (run2: the same command again, in a later call)

B="bench --target $TARGET --chat_template no --seed 1 --num_prompts 40 --max_new_tokens 32 --device cuda --temperature 0"
$LC $B --ckpt "$LILICORR" --benchmark humaneval --output "$OUT/bench-lilicorr-humaneval.json"
$LC $B --ckpt "$LILICORR" --benchmark $PROMPTS --output "$OUT/bench-lilicorr-stdlib.json"
$LC $B --ckpt "$DFLASH" --selectors top1 --benchmark humaneval --output "$OUT/bench-dflash-humaneval.json"
$LC $B --ckpt "$DFLASH" --selectors top1 --benchmark $PROMPTS --output "$OUT/bench-dflash-stdlib.json"
$LC $B --ckpt "$LILICORR" --benchmark humaneval --compile true --output "$OUT/bench-lilicorr-humaneval-compiled.json"

# A later session: the heads inside CUDA graphs (log-run2.txt; tests/gpu first, as above). The bench pair was run
# again with --selectors lilicorr,top1 (the *-swapped.json files), the round timings with and without $G.
G="--compile true --compile_mode reduce-overhead"
$LC $B --ckpt "$LILICORR" --benchmark humaneval $G --output "$OUT/bench-lilicorr-humaneval-cudagraphs.json"
$LC $B --ckpt "$LILICORR" --benchmark $PROMPTS $G --output "$OUT/bench-lilicorr-stdlib-cudagraphs.json"
$LC $B --ckpt "$LILICORR" --benchmark humaneval $G --selectors lilicorr,top1 --output "$OUT/bench-lilicorr-humaneval-cudagraphs-swapped.json"
$LC $B --ckpt "$LILICORR" --benchmark $PROMPTS $G --selectors lilicorr,top1 --output "$OUT/bench-lilicorr-stdlib-cudagraphs-swapped.json"
$LC perf --round_timing true -c configs/demo/base.yaml -c configs/demo/arms/lilicorr.yaml \
  --model.target.name_or_path="$TARGET" --device cuda $G --json "$OUT/round-timing-demo-shape-cudagraphs.json"
$LC perf --round_timing true -c configs/qwen3-8b/base.yaml -c configs/qwen3-8b/lilicorr.yaml \
  --target_config configs/qwen3-8b/Qwen3-8B.config.json --context 2048 --device cuda $G --json "$OUT/round-timing-qwen3-8b-cudagraphs.json"
# (eager, the same two commands without $G: round-timing-qwen3-8b-run3-balanced.json, round-timing-demo-shape-eager-run2.json)

# How the prompts file was written (on the machine that ran the demo):
#   python -c "import json; from transformers import AutoTokenizer; from lilicorr_pl.data.corpus import heldout_prefixes;
#   tok = AutoTokenizer.from_pretrained('TARGET_DIR'); f = open('stdlib-heldout-demo.jsonl', 'w');
#   [f.write(json.dumps({'prompt': t}) + '\n') for t in heldout_prefixes(tok, 40, 64, seed=1)]"
