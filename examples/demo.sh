#!/usr/bin/env bash
# The main job on the bundled model: convert stories260K (padded) with each preset, then print a perplexity
# table against the unquantized baseline (reference backend: CPU, fp32, through cublade's reference ops).
# Usage: bash examples/demo.sh [OUT_DIR]   (default runs/demo; checkpoints are rewritten each run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-runs/demo}
MODEL=fixtures/models/stories260K-padded-hf
TEXT=fixtures/data/tinystories_valid_head30k.txt
mkdir -p "$OUT"
convert() { local name=$1; shift; cublade convert "$MODEL" "$OUT/$name" --overwrite "$@"; }

convert fp8-dynamic --scheme fp8-dynamic
convert mxfp8 --scheme mxfp8
convert mxfp8-floor --scheme mxfp8 --scale-rule floor
convert w4a16 --scheme w4a16
convert w4a16-g32 --scheme w4a16 --group-size 32

echo
cublade ppl "$MODEL" "$OUT"/fp8-dynamic "$OUT"/mxfp8 "$OUT"/mxfp8-floor "$OUT"/w4a16 "$OUT"/w4a16-g32 --text "$TEXT"

# Calibrated checkpoints: calibrate on the first 6 stories, score everything on the other 13 (held out).
SPLIT=(--calib-text "$TEXT" --calib-lines 0:6)
convert w4a16-gptq --scheme w4a16 "${SPLIT[@]}"
convert w4a16-g32-gptq --scheme w4a16 --group-size 32 "${SPLIT[@]}"
convert fp8-static --scheme fp8-static "${SPLIT[@]}"
convert fp8-dynamic-kv --scheme fp8-dynamic --kv-cache fp8 "${SPLIT[@]}"
convert fp8-dynamic-kv-qa --scheme fp8-dynamic --kv-cache fp8 --kv-rounding query-aware "${SPLIT[@]}"

echo
echo "held-out split (stories 6-18; calibration used stories 0-5):"
cublade ppl "$MODEL" "$OUT"/w4a16 "$OUT"/w4a16-gptq "$OUT"/w4a16-g32 "$OUT"/w4a16-g32-gptq "$OUT"/fp8-dynamic \
  "$OUT"/fp8-static "$OUT"/fp8-dynamic-kv "$OUT"/fp8-dynamic-kv-qa --text "$TEXT" --lines 6:

# MoE: a Mixtral (8 experts, top-2) built from the dense model with permuted experts (its loss equals the
# dense model's), then FP4 experts + FP8 dense layers; the perturbed variant exercises a real router.
for v in exact perturbed; do
  python3 examples/make_moe_fixture.py "$OUT/moe-$v" --variant "$v" --overwrite
  for fmt in mxfp4 nvfp4; do
    cublade convert "$OUT/moe-$v" "$OUT/moe-$v-fp4-$fmt" --scheme fp4-experts-fp8-dense --fp4-format "$fmt" --overwrite
  done
done
echo
echo "MoE fixtures (all 19 stories):"
cublade ppl "$MODEL" "$OUT"/moe-exact "$OUT"/moe-exact-fp4-mxfp4 "$OUT"/moe-exact-fp4-nvfp4 \
  "$OUT"/moe-perturbed "$OUT"/moe-perturbed-fp4-mxfp4 "$OUT"/moe-perturbed-fp4-nvfp4 --text "$TEXT"
