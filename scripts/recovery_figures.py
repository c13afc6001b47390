#!/usr/bin/env python3
"""Recovery figures of `moetrain launch`: time to detect a dead rank (SIGKILL) and a stalled one
(SIGSTOP, caught by the collective watchdog), time to restart, and work lost per failure.

Each run trains a tiny MoE on 2 processes (EP = 2) under the supervisor with one injected fault
(MOETRAIN_FAULT) and timestamps every output line as it arrives:
  detect  = fault line -> the supervisor's "attempt 1 failed" line
  restart = "attempt 1 failed" -> the second attempt's "resumed from" line (back-off included)
  lost    = steps trained past the checkpoint the run resumed from
Medians over --runs runs.

  python3 scripts/recovery_figures.py build/moetrain [--runs 5] [--timeout 3] [--backoff 0]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

CONFIG = """[model]
vocab_size = 256
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
expert_hidden = 24
n_experts = 4
top_k = 2
max_seq_len = 16
[data]
dir = "{data}"
[train]
batch_size = 2
seq_len = 16
eval_every = 0
eval_batches = 2
progress = "off"
steps = 40
checkpoint_every = 10
"""


def timed_run(cmd, env):
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    proc.wait()
    return proc.returncode, lines


def first(lines, part):
    return next((t for t, text in lines if part in text), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=3.0, help="--collective-timeout, seconds")
    ap.add_argument("--backoff", type=float, default=0.0)
    args = ap.parse_args()
    binary = os.path.abspath(args.binary)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open("/usr/share/games/fortunes/fortunes", "rb") as src, open(corpus, "wb") as dst:
            dst.write(src.read(200000))
        subprocess.run([binary, "prepare", "--input", corpus, "--out", os.path.join(tmp, "data")],
                       check=True, capture_output=True)
        cfg = os.path.join(tmp, "run.toml")
        with open(cfg, "w") as f:
            f.write(CONFIG.format(data=os.path.join(tmp, "data")))
        for kind in ("kill", "stop"):
            detect, restart, lost = [], [], []
            for i in range(args.runs):
                step = 13 + 2 * i  # past the checkpoint of step 10, before the one of step 20
                run_dir = os.path.join(tmp, f"{kind}{i}")
                cmd = [binary, "launch", "-n", "2", "--backoff", str(args.backoff),
                       "--mpi-arg=--oversubscribe", "--", "train", "-c", cfg, "--ep", "2",
                       "--collective-timeout", str(args.timeout),
                       "--set", f"train.run_dir={run_dir}"]
                code, lines = timed_run(cmd, dict(env, MOETRAIN_FAULT=f"{kind}:rank=1:step={step}"))
                if code != 0:
                    sys.exit(f"{kind} run {i} failed (exit {code}):\n" +
                             "\n".join(t for _, t in lines))
                fault = first(lines, "moetrain: fault injection")
                failed = first(lines, "attempt 1 failed")
                resumed = first(lines, "resumed from")
                at = next(int(m.group(1)) for _, t in lines
                          if (m := re.search(r"resumed from .* at step (\d+)", t)))
                detect.append(failed - fault)
                restart.append(resumed - failed)
                lost.append(step - at)
            print(f"{kind:4s} rank 1: detect {statistics.median(detect):.2f} s, restart "
                  f"{statistics.median(restart):.2f} s, work lost {statistics.median(lost):.0f} "
                  f"steps (checkpoint every 10); runs: detect "
                  + ", ".join(f"{d:.2f}" for d in detect))


if __name__ == "__main__":
    main()
