#!/usr/bin/env bash
# Ratio 128's prefill tiles in one device call: sweep the streaming pool's candidates at four plan
# sizes, write kernels.py copies with the winners (benchmarks.sweep_winners), A/B each against the
# working tree (benchmarks.ab_compress: outputs compared, same state bits), then, with the time left,
# the ratio-128 decode rows.
#   bash benchmarks/c128_tune.sh OUTDIR        # TOTAL=<seconds> bounds the whole (default 590)
set -u
out="${1:?usage: benchmarks/c128_tune.sh OUTDIR}"
total="${TOTAL:-590}"
mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/card.txt"
git log --oneline -1 | tee -a "$out/card.txt"
timeout $((total * 6 / 10)) python -m benchmarks.run --only sweep --groups "^streaming, prefill c128-main" \
    --configs c128-main --tokens 16384 4096 65536 8192 2>&1 | tee "$out/sweep-c128.log" | grep -E "^best|copy|failed"
echo "sweep done at ${SECONDS} s"
python -m benchmarks.sweep_winners "$out/sweep-c128.log" "$out" 2>&1 | tee "$out/winners.log"
for variant in "$out"/variant-*.py; do
    [ -e "$variant" ] || continue
    left=$((total - 30 - SECONDS))
    [ "$left" -gt 30 ] || break
    echo "== $variant"
    timeout $((left < 110 ? left : 110)) python -m benchmarks.ab_compress "$variant" --configs c128-main \
        --tokens 4096 8192 16384 65536 --batches 1 2>&1 | tee "$out/ab-$(basename "$variant" .py).log"
done
left=$((total - 10 - SECONDS))
if [ "$left" -gt 60 ]; then
    echo "== decode c128-main (${left} s left)"
    timeout "$left" python -m benchmarks.run --only decode --configs c128-main --out "$out/decode-c128" 2>&1 \
        | tee "$out/decode-c128.log" | tail -30
fi
echo "end at ${SECONDS} s"
