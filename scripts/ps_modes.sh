#!/usr/bin/env bash
# Parameter-server consistency modes (or pull encodings) side by side on one job, as docs/ps.md
# records them: each row is one `moetrain ps launch` of configs/tiny.toml with 1 server and 2
# workers; prints wall time (first to last update), tokens/s (rows of every applied push × seq_len
# over that time), updates, the servers' largest staleness, pull bytes, the training loss at the
# rows' common wall time (mean of the update losses in the last fifth of the shortest run's time)
# and the final validation loss.
#   scripts/ps_modes.sh OUT_DIR DATA_DIR STEPS "name|ps options[|train --set arguments]" ...
# e.g. scripts/ps_modes.sh /tmp/modes data/fortunes 60 "sync|--consistency sync --slowdown 1=2" \
#        "async|--consistency async --slowdown 1=2"
set -euo pipefail
out=$1 data=$2 steps=$3
shift 3
bin=${MOETRAIN:-build/moetrain}
mkdir -p "$out"
names=()
for row in "$@"; do
  IFS='|' read -r name opts sets <<<"$row"
  rm -rf "${out:?}/$name"
  # shellcheck disable=SC2086  # (the options split into words)
  "$bin" ps launch --servers 1 --workers 2 $opts -- train --config configs/tiny.toml \
    --set data.dir="$data" --set optim.grad_clip=0 --set train.steps="$steps" \
    --set train.batch_size=4 --set train.eval_every=0 --set train.progress=off \
    --set train.run_dir="$out/$name" ${sets:-} >"$out/$name.log" 2>&1
  names+=("$name")
done
python3 - "$out" "${names[@]}" <<'PY'
import json, sys, pathlib
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = {}
for n in names:
    lines = [json.loads(l) for l in open(out / n / "metrics.jsonl")]
    ups = [l for l in lines if "loss" in l and "time" in l]
    val = [l["val_loss"] for l in lines if "val_loss" in l][-1]
    srv = json.load(open(out / n / "ps" / "server_0.json"))
    opts = json.load(open(out / n / "checkpoints" / "latest" / "trainer_state.json"))
    bounded = opts["parameter_server"]["consistency"] in ("ssp", "half_sync")
    runs[n] = (ups, val, srv, bounded)
B = min(u[-1]["time"] - u[0]["time"] for u, *_ in runs.values())
print("| row | wall s | tokens/s | updates | max staleness | pull bytes | train loss at %.1f s | val loss |" % B)
print("|---|---|---|---|---|---|---|---|")
seq = 128  # configs/tiny.toml's train.seq_len
for n, (ups, val, srv, bounded) in runs.items():
    t0, wall = ups[0]["time"], ups[-1]["time"] - ups[0]["time"]
    tok = sum(u["rows"] for u in ups[1:]) * seq / wall  # the rows applied after the first update
    late = [u["loss"] for u in ups if 0.8 * B <= u["time"] - t0 <= B]
    stale = str(srv["max_staleness"]) if bounded else "–"  # recorded by the bounded modes only
    print("| %s | %.1f | %.0f | %d | %s | %d | %.4f | %.4f |" % (n, wall, tok, srv["updates"],
          stale, srv["pull_bytes"], sum(late) / len(late), val))
PY
