#!/usr/bin/env bash
# make demo: prepare the text of Debian's fortunes, train configs/tiny.toml on every core,
# report the validation loss, print a sample and write the run's HTML report.
set -euo pipefail
build=${1:-build}
bin="$build/moetrain"
data=data/fortunes
if [ ! -f "$data/train.bin" ] || [ ! -f "$data/val.bin" ]; then
  "$bin" prepare --input /usr/share/games/fortunes --out "$data"
fi
# The model of configs/tiny.toml with the demo's schedule: 64 sequences of 64 bytes a step, 1200
# steps, peak learning rate 6e-3, bf16 GEMMs where the CPU multiplies bf16 natively. Measured on a
# 2-core machine against other shapes and rates (docs/PERF.md, "The demo"): the steps are as many
# as train in under 3 minutes there with a margin, and reach 1.65 nats/byte.
schedule=(--set train.seq_len=64 --set train.batch_size=64 --set train.steps=1200
          --set optim.lr=6e-3 --set optim.warmup_steps=40 --set train.eval_every=240
          --set train.precision=auto)
# --resume: a second `make demo` continues (or just re-evaluates) the run instead of redoing it.
"$bin" train --config configs/tiny.toml --resume "${schedule[@]}" ${DEMO_ARGS:-}
echo
echo "== sample (temperature 0.8):"
# The sample is also kept in the run directory, where the report shows it.
"$bin" sample --checkpoint runs/tiny --prompt "${DEMO_PROMPT:-The meaning of life is }" --max-tokens 300 --seed 7 \
  | tee runs/tiny/sample.txt
echo
echo "== report (open it in a browser):"
"$bin" report runs/tiny
