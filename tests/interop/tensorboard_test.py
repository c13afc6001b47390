"""Our TensorBoard event files read by TensorBoard itself: every metric of metrics.jsonl, same step.

Usage: tensorboard_test.py MOETRAIN_BINARY SCRATCH_DIR

Trains a tiny model with the real `moetrain` binary (evaluation every 2 steps, a checkpoint every
3), loads RUN_DIR/tb with TensorBoard's own EventAccumulator and checks that its scalars are
exactly the numbers of metrics.jsonl at the same steps (as float32, TensorBoard's simple_value),
under the grouped tags docs/metrics.md lists (train/loss, eval/loss, moe/layer_0/..., comm/...,
perf/...), each with a description, tag for tag and nothing more, and that tokens_per_expert
arrived as one histogram per layer whose buckets are the experts' counts. Then the run is resumed from its step-3 checkpoint (the step-6
one removed, as after a crash): the new event file must make TensorBoard drop the replaced run's
steps 4..6, so that the directory again reads as metrics.jsonl.

Exits non-zero naming the first tag or step that disagrees.
"""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator as ea

SOURCE_DIR = Path(__file__).resolve().parents[2]
CORPUS = Path("/usr/share/games/fortunes/fortunes")  # Debian package fortunes-min

TINY = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
    "model.expert_hidden=32", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=32",
    "train.steps=6", "train.batch_size=2", "train.seq_len=32", "train.eval_batches=1",
    "train.eval_every=2", "train.checkpoint_every=3", "train.progress=off",
]


# metrics.jsonl key -> TensorBoard tag, as docs/metrics.md lists them; per-layer keys become
# moe/layer_i/KEY.
TAGS = {
    "loss": "train/loss", "ce": "train/ce", "aux": "train/aux", "z": "train/z", "lr": "train/lr",
    "grad_norm": "train/grad_norm", "val_loss": "eval/loss", "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s", "compute_s": "perf/compute_s",
    "grad_accum_efficiency": "perf/grad_accum_efficiency", "comm_total_s": "comm/total_s",
    "comm_exposed_s": "comm/exposed_s", "comm_efficiency": "comm/efficiency",
    "overlap_ratio": "comm/overlap_ratio", "bytes_a2a": "comm/bytes_a2a",
    "bytes_grad": "comm/bytes_grad", "imbalance": "moe/imbalance",
    "rss_bytes": "memory/rss_bytes", "peak_rss_bytes": "memory/peak_rss_bytes",
    "peak_rss_bytes_max": "memory/peak_rss_bytes_max",
}
PER_LAYER = {"dropped_fraction", "load_entropy", "rank_max_mean_load", "capacity_factor",
             "capacity_utilisation", "tokens_per_expert", "expert_utilisation", "max_mean_load"}


def tag(key, layer=None):
    if layer is None:
        if key not in TAGS:
            raise Mismatch(f"metrics.jsonl has '{key}', which this test does not know")
        return TAGS[key]
    if key not in PER_LAYER:
        raise Mismatch(f"metrics.jsonl has per-layer '{key}', which this test does not know")
    return f"moe/layer_{layer}/{key}"


class Mismatch(Exception):
    pass


def run(cmd):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if res.returncode != 0:
        raise Mismatch(f"command failed ({res.returncode}): {' '.join(map(str, cmd))}\n"
                       f"{res.stdout}{res.stderr}")


def f32(x):
    """x rounded to float32, as TensorBoard stores a scalar."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def expected(run_dir):
    """(scalars: tag -> [(step, value)], histograms: tag -> [(step, bucket counts)]) from
    metrics.jsonl, by the mapping io/metrics.h documents."""
    scalars, histos = {}, {}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    for line in map(json.loads, lines):
        if "step" not in line:
            continue
        step = line["step"]
        for key, v in line.items():
            if key == "step":
                continue
            if isinstance(v, bool):
                scalars.setdefault(tag(key), []).append((step, float(v)))
            elif isinstance(v, (int, float)):
                scalars.setdefault(tag(key), []).append((step, f32(v)))
            elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                for i, x in enumerate(v):
                    scalars.setdefault(tag(key, i), []).append((step, f32(x)))
            elif isinstance(v, list) and v and all(isinstance(r, list) for r in v):
                for i, row in enumerate(v):
                    histos.setdefault(tag(key, i), []).append((step, [float(c) for c in row]))
                    if key != "tokens_per_expert":
                        continue
                    used = sum(1 for c in row if c > 0) / len(row)
                    mean = sum(row) / len(row)
                    scalars.setdefault(tag("expert_utilisation", i), []).append((step, f32(used)))
                    scalars.setdefault(tag("max_mean_load", i), []).append(
                        (step, f32(max(row) / mean if mean > 0 else 1.0)))
    return scalars, histos


def check(run_dir, what):
    acc = ea.EventAccumulator(str(run_dir / "tb"), size_guidance={
        ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.COMPRESSED_HISTOGRAMS: 0})
    acc.Reload()
    scalars, histos = expected(run_dir)
    for want in ("train/loss", "train/ce", "train/aux", "train/z", "train/lr", "train/grad_norm",
                 "perf/tokens_per_s", "eval/loss", "moe/imbalance", "comm/efficiency",
                 "comm/total_s", "comm/exposed_s", "comm/overlap_ratio", "comm/bytes_grad",
                 "moe/layer_0/dropped_fraction", "moe/layer_1/expert_utilisation",
                 "moe/layer_0/max_mean_load"):
        if want not in scalars:
            raise Mismatch(f"{what}: metrics.jsonl has no '{want}' (the test's premise)")
    tags = acc.Tags()
    if sorted(tags["scalars"]) != sorted(scalars):
        raise Mismatch(f"{what}: scalar tags differ\n  tensorboard: {sorted(tags['scalars'])}\n"
                       f"  metrics.jsonl: {sorted(scalars)}")
    for tag, want in scalars.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        if got != want:
            raise Mismatch(f"{what}: scalar '{tag}'\n  tensorboard: {got}\n  metrics.jsonl: {want}")
    if sorted(tags["histograms"]) != sorted(histos):
        raise Mismatch(f"{what}: histogram tags differ: {sorted(tags['histograms'])} vs "
                       f"{sorted(histos)}")
    for tag, want in histos.items():
        got = [(e.step, list(e.histogram_value.bucket)) for e in acc.Histograms(tag)]
        if got != want:
            raise Mismatch(f"{what}: histogram '{tag}'\n  tensorboard: {got}\n  metrics.jsonl: {want}")
        for e in acc.Histograms(tag):
            h = e.histogram_value
            n = len(h.bucket)
            if list(h.bucket_limit) != [float(i + 1) for i in range(n)] or h.num != sum(h.bucket):
                raise Mismatch(f"{what}: histogram '{tag}' at step {e.step}: limits "
                               f"{list(h.bucket_limit)}, num {h.num}, buckets {list(h.bucket)}")
    for t in list(scalars) + list(histos):
        if not acc.SummaryMetadata(t).summary_description:
            raise Mismatch(f"{what}: tag '{t}' has no description")
    n = sum(len(v) for v in scalars.values())
    print(f"{what}: {len(scalars)} scalar tags ({n} values) and {len(histos)} histogram tags "
          f"agree with metrics.jsonl")


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    moetrain, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    if not moetrain.is_file():
        print(f"FAIL: no moetrain binary at {moetrain}", file=sys.stderr)
        return 1
    if not CORPUS.is_file():
        print(f"FAIL: {CORPUS} is missing: install Debian's fortunes-min (scripts/setup.sh does)",
              file=sys.stderr)
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    corpus = scratch / "corpus.txt"
    corpus.write_bytes(CORPUS.read_bytes()[:8192])
    run_dir = scratch / "run"
    cmd = [moetrain, "train", "--config", SOURCE_DIR / "configs" / "tiny.toml"]
    for s in TINY + [f"train.run_dir={run_dir}", f"data.dir={scratch / 'data'}"]:
        cmd += ["--set", s]
    try:
        run([moetrain, "prepare", "--input", corpus, "--out", scratch / "data"])
        run(cmd)
        check(run_dir, "fresh run")
        # As if the run had died after its step-3 checkpoint: steps 4..6 are done again.
        ckpts = run_dir / "checkpoints"
        shutil.rmtree(ckpts / "step_00000006")
        (ckpts / "latest").unlink()
        (ckpts / "latest").symlink_to("step_00000003")
        run(cmd + ["--resume"])
        files = sorted((run_dir / "tb").iterdir())
        if len(files) != 2:
            raise Mismatch(f"resumed run: expected 2 event files in {run_dir / 'tb'}, have {files}")
        check(run_dir, "resumed run")
    except Mismatch as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print("PASS: TensorBoard reads every metric of metrics.jsonl at its step")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
