"""Train on your own text, end to end, and open the result in Hugging Face transformers.

Usage: hf_tokenizer_test.py MOETRAIN_BINARY SCRATCH_DIR

With the real `moetrain` binary: a SentencePiece tokenizer (vocabulary 2,048) trained on the
fortunes text, the text prepared with it, a model trained 200 steps (its vocabulary taken from the
tokenizer), text sampled. Then, with transformers:
  - AutoTokenizer on the run's checkpoints/latest encodes sentences to moetrain's ids, and
    decodes them back;
  - pipeline("text-generation") on checkpoints/latest continues a prompt greedily exactly as
    `moetrain sample --temperature 0` does;
  - a Hugging Face Mixtral directory written by transformers (model and tokenizer, tokenizer.model
    among its files) samples through `moetrain sample --checkpoint DIR --prompt ...` with the
    same greedy text as transformers' pipeline on it;
  - a shard prepared with another tokenizer is refused by `moetrain eval`, naming both.
Exits non-zero naming the first disagreement.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, MixtralForCausalLM, pipeline

SOURCE_DIR = Path(__file__).resolve().parents[2]
CORPUS = Path("/usr/share/games/fortunes/fortunes")  # Debian package fortunes-min
SENTENCES = [
    "The meaning of life is to find your gift.",
    "Q: How many programmers does it take to change a light bulb?  A: None.",
    "Numbers 2024 and tabs\tand a naïve café ✓ stay as they are.",
]
PROMPT = "Q: What is"
NEW_TOKENS = 24

TRAIN = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.expert_hidden=96", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=128",
    "train.steps=200", "train.batch_size=8", "train.seq_len=64", "train.eval_batches=2",
    "train.eval_every=0", "train.checkpoint_every=0", "train.progress=off",
    "optim.lr=1e-2", "optim.warmup_steps=5", "train.precision=f32",
]


class Mismatch(Exception):
    pass


def run(cmd, expect_ok=True):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if expect_ok and res.returncode != 0:
        raise Mismatch(f"{' '.join(map(str, cmd))} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def greedy(model_dir):
    """transformers' greedy continuation of PROMPT, through pipeline()."""
    gen = pipeline("text-generation", model=str(model_dir), torch_dtype=torch.float32,
                   model_kwargs={"attn_implementation": "eager"})
    out = gen(PROMPT, do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0]["generated_text"]


def sample(moetrain, model_dir):
    res = run([moetrain, "sample", "--checkpoint", model_dir, "--prompt", PROMPT,
               "--temperature", "0", "--max-tokens", NEW_TOKENS])
    text = res.stdout
    return text[:-1] if text.endswith("\n") else text


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    moetrain, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        tok_dir, data, run_dir = scratch / "tok", scratch / "data", scratch / "run"
        run([moetrain, "tokenizer", "train", "--input", CORPUS, "--vocab-size", 2048,
             "--out", tok_dir])
        run([moetrain, "prepare", "--input", CORPUS, "--tokenizer", tok_dir, "--out", data,
             "--no-progress"])
        cmd = [moetrain, "train", "--config", SOURCE_DIR / "configs" / "tiny.toml",
               "--run-dir", run_dir, "--set", f"data.dir={data}"]
        for s in TRAIN:
            cmd += ["--set", s]
        run(cmd)
        latest = run_dir / "checkpoints" / "latest"
        hf_config = (latest / "config.json").read_text()
        if '"vocab_size": 2048' not in hf_config:
            raise Mismatch(f"{latest}/config.json: the model's vocabulary is not the tokenizer's 2048")

        print("AutoTokenizer on checkpoints/latest")
        for use_fast in (False, True):
            theirs = AutoTokenizer.from_pretrained(str(latest), use_fast=use_fast)
            for s in SENTENCES:
                ours = [int(t) for t in run([moetrain, "tokenizer", "encode", "--tokenizer", latest, s]).stdout.split()]
                ids = theirs(s)["input_ids"]
                if ids != ours:
                    raise Mismatch(f"use_fast={use_fast}: {s!r}: transformers {ids}, moetrain {ours}")
                back = theirs.decode(ids)
                if back != s:
                    raise Mismatch(f"use_fast={use_fast}: decode gives {back!r}, not {s!r}")
            print(f"  {type(theirs).__name__}: {len(SENTENCES)} sentences, same ids, same text back")

        print("greedy continuation: pipeline vs moetrain sample")
        theirs, ours = greedy(latest), sample(moetrain, latest)
        print(f"  transformers: {theirs!r}\n  moetrain:     {ours!r}")
        if theirs != ours:
            raise Mismatch("the greedy continuations differ")

        print("a Hugging Face Mixtral directory with tokenizer.model")
        hf = scratch / "hf"
        MixtralForCausalLM.from_pretrained(str(latest)).save_pretrained(str(hf))
        AutoTokenizer.from_pretrained(str(latest)).save_pretrained(str(hf))
        if not (hf / "tokenizer.model").is_file():
            raise Mismatch(f"{hf}: transformers wrote no tokenizer.model: {sorted(p.name for p in hf.iterdir())}")
        theirs, ours = greedy(hf), sample(moetrain, hf)
        print(f"  transformers: {theirs!r}\n  moetrain:     {ours!r}")
        if theirs != ours:
            raise Mismatch(f"{hf}: the greedy continuations differ")

        print("a shard made with another tokenizer")
        bytes_data = scratch / "bytes_data"
        run([moetrain, "prepare", "--input", CORPUS, "--out", bytes_data, "--no-progress"])
        res = run([moetrain, "eval", "--checkpoint", run_dir, "--data", bytes_data], expect_ok=False)
        text = res.stdout + res.stderr
        if res.returncode == 0 or "byte" not in text or "sentencepiece:" not in text \
                or str(bytes_data / "meta.json") not in text:
            raise Mismatch(f"eval on byte shards: expected a refusal naming both tokenizers, got "
                           f"exit {res.returncode}:\n{text}")
        print(f"  refused: {text.strip().splitlines()[-1]}")
    except Mismatch as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
