"""The demo's LM trained by moetrain and by PyTorch for the same wall time, in one run.

Both read the config (configs/demo.toml by default: model, batch, sequence length, AdamW, the
learning-rate schedule) and the same token shards (`moetrain prepare`'s train.bin and val.bin).
Ours is `moetrain train` itself: its metrics.jsonl gives every step's time, and once those add up
to --seconds it is stopped with SIGTERM (it finishes the step and writes a checkpoint), then
`moetrain eval` measures the validation loss. Theirs is torch_models.MoeLm, eager and
torch.compile'd, stopped after the step at which its step times add up to --seconds
(compilation included: it is part of a compiled run's wall time), then evaluated on the same
windows (the first eval_batches x batch_size windows of val.bin). tokens/s is the median step's,
after two warm-up steps. Each round runs ours and every PyTorch variant in turn, ours first in odd
rounds and last in even ones; a round's ratio is ours over its fastest PyTorch variant, and the
ratios' median is the figure. Every run, ours and each of theirs, starts in a process of its own.

--precision auto (the default, the demo's setting) runs ours at train.precision = auto and PyTorch
in both precisions (f32, and bf16 autocast), eager and compiled, so that the fastest thing a
PyTorch user could run is measured in the same round as ours; f32 or bf16 runs both in that one.

  .venv-bench/bin/python bench/peers/lm.py --moetrain build/moetrain --seconds 60
"""
import argparse
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import (LmConfig, MoeLm, Windows, load_moetrain_weights, lr_at,  # noqa: E402
                          read_shard)


def settings(path, data_dir):
    with open(path, "rb") as f:
        t = tomllib.load(f)
    m, o, tr = t.get("model", {}), t.get("optim", {}), t.get("train", {})
    for key, want in (("router", "topk_softmax"), ("capacity_factor", 0.0), ("name", "adamw"),
                      ("schedule", "cosine")):
        have = m.get(key, o.get(key, want))
        if have != want:
            sys.exit(f"lm.py: {path}: {key} = {have!r}; the PyTorch model has {want!r} only")
    cfg = LmConfig(dim=m["dim"], n_layers=m["n_layers"], n_heads=m["n_heads"],
                   n_kv_heads=m.get("n_kv_heads", m["n_heads"]), expert_hidden=m["expert_hidden"],
                   n_experts=m["n_experts"], top_k=m["top_k"],
                   rope_theta=m.get("rope_theta", 1e6), aux_coef=m.get("aux_loss_coef", 0.01),
                   z_coef=m.get("z_loss_coef", 0.0))
    return {"model": cfg, "B": tr["batch_size"], "T": tr["seq_len"], "steps": tr["steps"],
            "eval_batches": tr.get("eval_batches", 20), "seed": tr.get("seed", 1234),
            "lr": o["lr"], "min_lr": o.get("min_lr", 0.0), "warmup": o.get("warmup_steps", 0),
            "wd": o.get("weight_decay", 0.0), "clip": o.get("grad_clip", 0.0),
            "betas": (o.get("beta1", 0.9), o.get("beta2", 0.95)), "eps": o.get("eps", 1e-8),
            "data": data_dir or t["data"]["dir"]}


def steady(step_times):
    return statistics.median(step_times[2:] if len(step_times) > 4 else step_times)


def ours_cmd(args, s, run_dir):
    return [args.moetrain, "train", "-c", args.config, "--run-dir", run_dir,
            "--precision", args.precision, "--set", f"data.dir={s['data']}",
            "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
            "--set", "train.tensorboard=false", "--set", "train.progress=off"]


def ours_val_loss(args, run_dir, batches):
    out = subprocess.run([args.moetrain, "eval", "--checkpoint", run_dir, "--batches",
                          str(batches)], check=True, capture_output=True, text=True)
    return float(re.search(r"validation loss ([0-9.]+)", out.stdout + out.stderr).group(1))


def evaluate(model, s, batches, bf16=False):
    val = Windows(read_shard(os.path.join(s["data"], "val.bin")), s["T"])
    total = count = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for x, y in val.eval_batches(s["B"], batches):
            _, ce = model(x, y)
            total, count = total + ce.item() * y.numel(), count + y.numel()
    return total / count


def check_same_model(args, s):
    """The PyTorch model is moetrain's: a moetrain checkpoint after 3 f32 steps, loaded into it,
    gives moetrain's own validation loss on 2 batches (to 1e-3: summation order, f32)."""
    run_dir = tempfile.mkdtemp(prefix="peers_check_")
    cmd = ours_cmd(args, s, run_dir)
    cmd[cmd.index("--precision") + 1] = "f32"
    subprocess.run(cmd + ["--steps", "3"], check=True, capture_output=True)
    want = ours_val_loss(args, run_dir, 2)
    model = MoeLm(s["model"], s["T"])
    step_dirs = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    load_moetrain_weights(model, os.path.join(run_dir, "checkpoints", step_dirs[-1],
                                              "model.safetensors"))
    have = evaluate(model, s, 2)
    subprocess.run(["rm", "-rf", run_dir], check=False)
    print(f"same model: moetrain's checkpoint after 3 steps, validation loss {want:.5f} in "
          f"moetrain, {have:.5f} in PyTorch")
    if abs(want - have) > 1e-3:
        sys.exit("lm.py: the PyTorch model does not compute moetrain's model; no comparison")


def run_ours(args, s):
    run_dir = tempfile.mkdtemp(prefix="peers_lm_")
    cmd = ours_cmd(args, s, run_dir)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, times = os.path.join(run_dir, "metrics.jsonl"), []
    stopped = False
    while proc.poll() is None:
        time.sleep(0.05)
        if stopped or not os.path.exists(metrics):
            continue
        # A line the trainer is still writing has no newline yet: read it next time.
        with open(metrics) as f:
            times = [json.loads(line)["step_time_s"] for line in f
                     if line.endswith("\n") and '"step_time_s"' in line]
        if sum(times) >= args.seconds:
            proc.send_signal(signal.SIGTERM)
            stopped = True
    err = proc.stderr.read()
    if proc.returncode not in (0, 143):
        sys.exit(f"lm.py: {' '.join(cmd)} exited {proc.returncode}:\n{err}")
    with open(metrics) as f:
        times = [json.loads(line)["step_time_s"] for line in f if '"step_time_s"' in line]
    val = ours_val_loss(args, run_dir, s["eval_batches"])
    subprocess.run(["rm", "-rf", run_dir], check=False)
    return {"steps": len(times), "train_s": sum(times),
            "tokens_per_s": s["B"] * s["T"] / steady(times), "val_loss": val}


def run_theirs_fresh(args, s, compiled, bf16):
    """run_theirs in a fresh Python process, as a user's run starts: in one long-lived process
    PyTorch's later runs were 8-15% slower than its first (both variants, both precisions), which
    would credit moetrain with PyTorch's own slowdown."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_theirs, (args, s, compiled, bf16))


def run_theirs(args, s, compiled, bf16):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    torch.manual_seed(s["seed"])
    model = MoeLm(s["model"], s["T"])
    opt = torch.optim.AdamW(model.param_groups(s["wd"]), lr=s["lr"], betas=s["betas"],
                            eps=s["eps"])
    fn = torch.compile(model) if compiled else model
    train = Windows(read_shard(os.path.join(s["data"], "train.bin")), s["T"], s["seed"])
    times, step, val = [], 0, None
    # Past the wall time, the validation loss is taken; a run that got fewer than 8 steps by then
    # (compilation) goes on to 8 for its tokens/s.
    while sum(times) < args.seconds or step < 8:
        if val is None and sum(times) >= args.seconds:
            val, val_steps, val_s = evaluate(model, s, s["eval_batches"], bf16), step, sum(times)
        t0 = time.perf_counter()
        x, y = train.next_batch(s["B"])
        lr = lr_at(step, s["lr"], s["min_lr"], s["warmup"], s["steps"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = fn(x, y)
        loss.backward()
        if s["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"])
        opt.step()
        times.append(time.perf_counter() - t0)
        step += 1
    if val is None:
        val, val_steps, val_s = evaluate(model, s, s["eval_batches"], bf16), step, sum(times)
    return {"steps": val_steps, "train_s": val_s, "first_step_s": times[0],
            "tokens_per_s": s["B"] * s["T"] / steady(times), "val_loss": val}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moetrain", default="build/moetrain")
    ap.add_argument("--config", default="configs/demo.toml")
    ap.add_argument("--data", help="directory of train.bin and val.bin (default: the config's)")
    ap.add_argument("--seconds", type=float, default=60.0, help="training wall time per side")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--precision", choices=("auto", "f32", "bf16"), default="auto",
                    help="ours: train.precision; PyTorch: f32, bf16 autocast, or both for auto")
    ap.add_argument("--modes", default="eager,compile", help="PyTorch variants")
    ap.add_argument("--json", default="out/bench/peers_lm.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    s = settings(args.config, args.data)
    precisions = ("f32", "bf16") if args.precision == "auto" else (args.precision,)
    variants = [(m, p) for p in precisions for m in args.modes.split(",")]
    name = lambda m, p: m if len(precisions) == 1 else f"{m} {p}"  # noqa: E731
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.config}: batch "
          f"{s['B']} x {s['T']} tokens, {args.seconds:g} s of training per side; moetrain at "
          f"{args.precision}, PyTorch in {' and '.join(precisions)}")
    check_same_model(args, s)
    res = {k: [] for k in ["ours"] + [name(m, p) for m, p in variants]}
    ratios = []
    for r in range(args.rounds):
        # Ours first in odd rounds and last in even ones: the machine's drift over a round's
        # minutes then favours neither side across a pair of rounds.
        if r % 2 == 0:
            res["ours"].append(run_ours(args, s))
        for m, p in list(variants):
            try:
                res[name(m, p)].append(run_theirs_fresh(args, s, m == "compile", p == "bf16"))
            except Exception as e:  # noqa: BLE001 - report torch.compile failing and go on
                print(f"torch {name(m, p)} failed on this machine: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}")
                variants.remove((m, p))
                del res[name(m, p)]
        if r % 2 == 1:
            res["ours"].append(run_ours(args, s))
        for k in res:
            v = res[k][-1]
            print(f"round {r + 1} {k}: {v['steps']} steps in {v['train_s']:.1f} s, "
                  f"{v['tokens_per_s']:,.0f} tokens/s, validation loss {v['val_loss']:.4f}" +
                  (f" (first step {v['first_step_s']:.1f} s)" if "first_step_s" in v else ""),
                  flush=True)
        best = max((k for k in res if k != "ours"), key=lambda k: res[k][-1]["tokens_per_s"])
        ratios.append(res["ours"][-1]["tokens_per_s"] / res[best][-1]["tokens_per_s"])
        print(f"round {r + 1}: moetrain / the fastest PyTorch variant ({best}) = "
              f"{ratios[-1]:.2f}", flush=True)

    med = lambda k, f: statistics.median(v[f] for v in res[k])  # noqa: E731
    ours_tps = med("ours", "tokens_per_s")
    print(f"\nLM ({args.config}), {args.seconds:g} s of training, medians of {args.rounds} rounds "
          f"(torch {torch.__version__})")
    # Tokens trained over the wall time (first steps and compilation included), and the median
    # step's rate.
    for k in res:
        for v in res[k]:
            v["run_tokens_per_s"] = v["steps"] * s["B"] * s["T"] / v["train_s"]
    ours_run = med("ours", "run_tokens_per_s")
    print("| trainer | steps | tokens/s over the run | moetrain / this | tokens/s, median step | "
          "moetrain / this | validation loss (nats/byte) |")
    print("|---|---|---|---|---|---|---|")
    for k in res:
        label = f"moetrain ({args.precision})" if k == "ours" else f"torch {k}"
        print(f"| {label} | {med(k, 'steps'):.0f} | {med(k, 'run_tokens_per_s'):,.0f} | "
              f"{ours_run / med(k, 'run_tokens_per_s'):.2f} | {med(k, 'tokens_per_s'):,.0f} | "
              f"{ours_tps / med(k, 'tokens_per_s'):.2f} | {med(k, 'val_loss'):.4f} |")
    print(f"moetrain / the fastest PyTorch variant of each round, median step: "
          f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "config": args.config, "seconds": args.seconds,
                   "precision": args.precision, "ratios": ratios, "rounds": res}, f, indent=1)


if __name__ == "__main__":
    main()
