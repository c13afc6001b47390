"""moetrain's MoE layer against the same layer in PyTorch, forward + backward, in one run.

Ours is bench/bench_moe_layer's moe_layer/topk_softmax_{f32,bf16} at the same shape (one process
per measurement); theirs is torch_models.MoeBlock (Mixtral's expert loop) with f32 weights, eager
and torch.compile'd, f32 and bf16 autocast. Each round measures every variant once, in turn, so
that the machine's drift reaches all of them alike; the ratio is ours / the faster of PyTorch's
two in the same round (tokens/s), and the medians over rounds are reported.

  .venv-bench/bin/python bench/peers/moe_layer.py --bench build/bench/bench_moe_layer
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import MoeBlock  # noqa: E402

# The shapes bench_moe_layer registers: (C, F, E, K, N).
SHAPES = {"mixtral": (512, 1024, 8, 2, 4096), "tiny": (128, 256, 8, 2, 2048)}
AUX_COEF, Z_COEF = 0.01, 0.001


def ours(binary, shape, precision, seconds):
    C, F_, E, K, N = shape
    bf = 1 if precision == "bf16" else 0
    name = f"moe_layer/topk_softmax_{precision}/C:{C}/F:{F_}/E:{E}/K:{K}/N:{N}/bf16:{bf}/real_time"
    out = subprocess.run([binary, f"--benchmark_filter=^{name}$", f"--benchmark_min_time={seconds}",
                          "--benchmark_format=json"], check=True, capture_output=True, text=True)
    b = json.loads(out.stdout)["benchmarks"][0]
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
    return N / (b["real_time"] * scale)


class Theirs:
    """One PyTorch variant: a step is zero grads, forward, backward of <y, dy> + the losses."""

    def __init__(self, shape, precision, compiled):
        C, F_, E, K, N = shape
        torch.manual_seed(7)
        self.N = N
        self.block = MoeBlock(C, F_, E, K)
        for p in self.block.parameters():
            torch.nn.init.normal_(p, 0.0, 0.05)
        self.x = torch.randn(N, C, requires_grad=True)
        self.dy = torch.randn(N, C) * 1e-3
        self.bf16 = precision == "bf16"
        self.fn = torch.compile(self.block) if compiled else self.block
        self.first_s = None  # the first steps' time (compilation)

    def step(self):
        self.block.zero_grad(set_to_none=True)
        self.x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            y, aux, z = self.fn(self.x)
        ((y.float() * self.dy).sum() + AUX_COEF * aux + Z_COEF * z).backward()

    def warm(self, steps):
        t = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.first_s = time.perf_counter() - t

    def tokens_per_s(self, seconds):
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
        return self.N * n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="build/bench/bench_moe_layer", help="bench_moe_layer binary")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--precisions", default="f32,bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per variant a round")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--json", default="out/bench/peers_moe_layer.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    shape = SHAPES[args.shape]
    precisions = args.precisions.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shape C, F, E, K, N = "
          f"{shape}; {args.rounds} rounds of {args.seconds} s a variant")

    variants = {}
    for p in precisions:
        variants[(p, "eager")] = Theirs(shape, p, False)
        variants[(p, "eager")].warm(2)
        if args.no_compile:
            continue
        v = Theirs(shape, p, True)
        try:
            v.warm(3)
            variants[(p, "compile")] = v
            print(f"torch.compile {p}: first 3 steps {v.first_s:.1f} s (compilation)")
        except Exception as e:  # noqa: BLE001 - any failure: report it and go on eagerly
            print(f"torch.compile {p} failed on this machine, eager only: "
                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    rows = {p: {"ours": [], "eager": [], "compile": [], "ratio": []} for p in precisions}
    for r in range(args.rounds):
        for p in precisions:
            row = rows[p]
            row["ours"].append(ours(args.bench, shape, p, args.seconds))
            best = 0.0
            for mode in ("eager", "compile"):
                if (p, mode) in variants:
                    row[mode].append(variants[(p, mode)].tokens_per_s(args.seconds))
                    best = max(best, row[mode][-1])
            row["ratio"].append(row["ours"][-1] / best)
            print(f"round {r + 1} {p}: ours {row['ours'][-1]:,.0f} tokens/s, torch eager "
                  f"{row['eager'][-1]:,.0f}" +
                  (f", compiled {row['compile'][-1]:,.0f}" if row["compile"] else "") +
                  f"; ours / best {row['ratio'][-1]:.2f}", flush=True)

    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    print(f"\nMoE layer fwd + bwd, tokens/s, medians of {args.rounds} rounds (torch "
          f"{torch.__version__})")
    print("| precision | moetrain | torch eager | torch compile | moetrain / best torch |")
    print("|---|---|---|---|---|")
    fmt = lambda v: f"{v:,.0f}" if v else "failed"  # noqa: E731
    for p in precisions:
        row = rows[p]
        print(f"| {p} | {fmt(med(row['ours']))} | {fmt(med(row['eager']))} | "
              f"{fmt(med(row['compile']))} | **{med(row['ratio']):.2f}** |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "shape": shape, "threads": torch.get_num_threads(),
                   "rounds": rows}, f, indent=1)


if __name__ == "__main__":
    main()
