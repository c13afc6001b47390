"""Checkpoints that transformers writes, loaded by moetrain: same logits, and they train.

Usage: hf_load_test.py MOETRAIN_BINARY SCRATCH_DIR

Saves a tiny random MixtralForCausalLM with save_pretrained three ways (one float32
model.safetensors; float32 cut into shards with model.safetensors.index.json; bfloat16), runs
`moetrain forward --checkpoint DIR` on each and compares the logits with transformers' own on the
same weights. Then `moetrain train --init-from DIR` trains from the float32 one on a few KB of the
fortunes corpus: the loss must be finite and fall. Directories moetrain must refuse (an extra
tensor, a missing one, a config it cannot compute) must fail naming what is wrong.

Exits non-zero naming the first check that fails.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM

SOURCE_DIR = Path(__file__).resolve().parents[2]
CORPUS = Path("/usr/share/games/fortunes/fortunes")  # Debian package fortunes-min
TEXT = "Q: What is the difference between a duck? A: One of its legs is both the same."
LOGITS_TOL = 1e-4  # float32 on both sides, different summation orders: about 1e-6 in practice

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=128, rope_theta=10000.0,
            rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
            initializer_range=0.1, router_aux_loss_coef=0.01)


class Failure(Exception):
    pass


def run(cmd, expect_ok=True):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if expect_ok and res.returncode != 0:
        raise Failure(f"command failed ({res.returncode}): {' '.join(map(str, cmd))}\n"
                      f"{res.stdout}{res.stderr}")
    return res


def save(model, path, **kwargs):
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if (path / "manifest.json").exists():
        raise Failure(f"{path}: transformers wrote a manifest?")
    return path


def check_forward(moetrain, model_dir, reference, scratch, name):
    out = scratch / f"{name}_out.safetensors"
    run([moetrain, "forward", "--checkpoint", model_dir, "--input", TEXT, "--out", out])
    ours = load_file(str(out))
    ids = torch.tensor(list(TEXT.encode("utf-8")))[None]
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits[0]
    diff = (ours["logits"] - theirs).abs().max().item()
    scale = max(1.0, theirs.abs().max().item())
    print(f"  {name}: logits max |diff| {diff:.3e} (scale {scale:.3e}, tolerance {LOGITS_TOL:.0e})")
    if not diff / scale <= LOGITS_TOL:
        raise Failure(f"{name}: moetrain's logits differ from transformers' by {diff:.3e}")


def reference_of(model_dir):
    """transformers' own model of the directory, in float32 (bf16 weights widen exactly)."""
    model = MixtralForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                               attn_implementation="eager")
    return model.eval()


def expect_refusal(moetrain, model_dir, words, scratch):
    res = run([moetrain, "forward", "--checkpoint", model_dir, "--input", TEXT,
               "--out", scratch / "refused.safetensors"], expect_ok=False)
    text = res.stdout + res.stderr
    if res.returncode == 0 or not all(w in text for w in words):
        raise Failure(f"{model_dir}: expected a refusal naming {words}, got exit {res.returncode}:\n{text}")
    print(f"  refused {model_dir.name}: {text.strip().splitlines()[-1]}")


def losses(run_dir):
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [l["loss"] for l in lines if "loss" in l and "step" in l]


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    moetrain, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    if not CORPUS.is_file():
        print(f"FAIL: {CORPUS} is missing: install Debian's fortunes-min", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        model = MixtralForCausalLM(MixtralConfig(**TINY)).eval()
        f32 = save(model, scratch / "hf_f32")
        sharded = save(model, scratch / "hf_sharded", max_shard_size="200KB")
        if not (sharded / "model.safetensors.index.json").is_file():
            raise Failure(f"{sharded}: save_pretrained wrote no index; shards: {sorted(sharded.iterdir())}")
        print(f"  sharded: {len(list(sharded.glob('model-*.safetensors')))} files")
        bf16 = save(MixtralForCausalLM(MixtralConfig(**TINY)).to(torch.bfloat16), scratch / "hf_bf16")
        stored = {t.dtype for t in load_file(str(bf16 / "model.safetensors")).values()}
        if stored != {torch.bfloat16}:
            raise Failure(f"{bf16}: expected bfloat16 tensors, save_pretrained wrote {stored}")
        # Confident wrong predictions: a start far above ln 256, which moetrain's own random
        # init (near ln 256) would not give, shows that training starts from these weights.
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)
        loud = save(model, scratch / "hf_loud")

        print("forward on directories transformers wrote")
        reference = reference_of(f32)
        check_forward(moetrain, f32, reference, scratch, "float32")
        check_forward(moetrain, sharded, reference, scratch, "sharded")
        check_forward(moetrain, bf16, reference_of(bf16), scratch, "bfloat16")

        print("directories moetrain must refuse")
        extra = scratch / "hf_extra"
        shutil.copytree(f32, extra)
        tensors = load_file(str(extra / "model.safetensors"))
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
        expect_refusal(moetrain, extra, ["model.layers.0.self_attn.q_proj.bias"], scratch)
        missing = scratch / "hf_missing"
        shutil.copytree(f32, missing)
        del tensors["model.layers.0.self_attn.q_proj.bias"]
        del tensors["model.norm.weight"]
        save_file(tensors, str(missing / "model.safetensors"), metadata={"format": "pt"})
        expect_refusal(moetrain, missing, ["model.norm.weight"], scratch)
        gelu = scratch / "hf_gelu"
        shutil.copytree(f32, gelu)
        cfg = json.loads((gelu / "config.json").read_text())
        cfg["hidden_act"] = "gelu"
        (gelu / "config.json").write_text(json.dumps(cfg))
        expect_refusal(moetrain, gelu, ["hidden_act", "gelu"], scratch)

        print("train --init-from a directory transformers wrote")
        corpus = scratch / "corpus.txt"
        corpus.write_bytes(CORPUS.read_bytes()[:16384])
        run([moetrain, "prepare", "--input", corpus, "--out", scratch / "data"])
        run_dir = scratch / "run"
        cmd = [moetrain, "train", "--config", SOURCE_DIR / "configs" / "tiny.toml", "--init-from", loud]
        for s in ["train.steps=12", "train.batch_size=4", "train.seq_len=64", "train.eval_batches=2",
                  "train.eval_every=0", "train.checkpoint_every=0", "train.progress=off",
                  "optim.lr=1e-2", "optim.warmup_steps=0", f"train.run_dir={run_dir}",
                  f"data.dir={scratch / 'data'}"]:
            cmd += ["--set", s]
        res = run(cmd)
        if "initial weights from" not in res.stdout + res.stderr:
            raise Failure(f"train --init-from did not say it loaded the weights:\n{res.stdout}{res.stderr}")
        ls = losses(run_dir)
        print(f"  losses: {' '.join(f'{l:.3f}' for l in ls)}")
        if len(ls) < 12 or not all(math.isfinite(l) for l in ls):
            raise Failure(f"train --init-from: expected 12 finite losses, got {ls}")
        if not ls[0] > math.log(256) + 2:
            raise Failure(f"train --init-from: the first loss {ls[0]:.3f} is what a random init gives "
                          f"(ln 256 = {math.log(256):.3f}), not what {loud.name}'s weights give")
        if not sum(ls[-3:]) / 3 < ls[0] - 1:
            raise Failure(f"train --init-from: the loss did not fall from {ls[0]:.3f} (last {ls[-3:]})")
        run_cfg = json.loads((run_dir / "run_config.json").read_text())
        if run_cfg["model"]["dim"] != 64 or run_cfg["model"]["expert_hidden"] != 96:
            raise Failure(f"{run_dir}/run_config.json: the run did not take the directory's architecture: "
                          f"{run_cfg['model']}")
    except Failure as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print("PASS: moetrain loads, computes and trains what transformers saved")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
