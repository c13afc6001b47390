#!/usr/bin/env bash
# make demo: prepare the text of Debian's fortunes, train configs/demo.toml on every core,
# report the validation loss, print a sample and write the run's HTML report.
set -euo pipefail
phase() { echo "== [$(date +%T)] $*"; }
build=${1:-build}
bin="$build/moetrain"
data=data/fortunes
if [ ! -f "$data/train.bin" ] || [ ! -f "$data/val.bin" ]; then
  phase "prepare $data"
  "$bin" prepare --input /usr/share/games/fortunes --out "$data"
fi
# configs/demo.toml: the model of configs/tiny.toml with the demo's schedule (its header says why).
# --resume: a second `make demo` continues (or just re-evaluates) the run instead of redoing it.
phase "train configs/demo.toml"
"$bin" train --config configs/demo.toml --resume ${DEMO_ARGS:-}
echo
phase "sample (temperature 0.8)"
# The sample is also kept in the run directory, where the report shows it.
"$bin" sample --checkpoint runs/tiny --prompt "${DEMO_PROMPT:-The meaning of life is }" --max-tokens 300 --seed 7 \
  | tee runs/tiny/sample.txt
echo
phase "report (open it in a browser)"
"$bin" report runs/tiny
phase "done"
