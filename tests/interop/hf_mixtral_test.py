"""Our checkpoints in Hugging Face transformers: same logits, same loss, same gradients.

Usage: hf_mixtral_test.py MOETRAIN_BINARY SCRATCH_DIR

Trains tiny models with the real `moetrain` binary on a few KB of the fortunes corpus, dumps
logits, losses and every parameter gradient with `moetrain forward --backward`, loads the same
checkpoint with transformers' MixtralForCausalLM and compares:

  run "ce"       aux_loss_coef = z_loss_coef = 0: logits, transformers' own cross-entropy
                 (labels=input_ids) and its autograd gradients against ours;
  run "balance"  large balancing coefficients: our aux and z losses recomputed in torch from
                 transformers' router logits, and the gradients of the total loss
                 ce + aux_coef·aux + z_coef·z;
  run "shared"   a model with a shared expert (moetrain-only): config.json must not claim
                 Mixtral, and transformers must not take it for one.

Exits non-zero naming the first quantity that disagrees; prints every maximum difference.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

SOURCE_DIR = Path(__file__).resolve().parents[2]
CORPUS = Path("/usr/share/games/fortunes/fortunes")  # Debian package fortunes-min
TEXT = ("Q: How many programmers does it take to change a light bulb? "
        "A: None, that's a hardware problem. Naïve? Maybe.")

# Tolerances, each relative to the scale of the quantity compared (its largest magnitude, at
# least 1 for logits and losses). float32 on both sides with different summation orders gives
# about 1e-7 relative on logits and 1e-6 on gradients; a real difference in the model (RoPE
# layout, norm eps, router normalisation) is orders of magnitude above these.
LOGITS_TOL = 1e-5
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4

TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.expert_hidden=96", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=128",
    "train.steps=8", "train.batch_size=4", "train.seq_len=64", "train.eval_batches=2",
    "train.eval_every=0", "train.checkpoint_every=0", "train.progress=off",
    "optim.lr=1e-2", "optim.warmup_steps=0",
]


class Mismatch(Exception):
    pass


def run(cmd):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if res.returncode != 0:
        raise Mismatch(f"command failed ({res.returncode}): {' '.join(map(str, cmd))}\n"
                       f"{res.stdout}{res.stderr}")
    return res.stdout


def train(moetrain, scratch, name, extra, launcher=()):
    run_dir = scratch / name
    sets = TINY + [f"train.run_dir={run_dir}", f"data.dir={scratch / 'data'}"] + extra
    cmd = [*launcher, moetrain, "train", "--config", SOURCE_DIR / "configs" / "tiny.toml"]
    for s in sets:
        cmd += ["--set", s]
    run(cmd)
    # `latest` links to the newest checkpoint: the path any program opens as that checkpoint.
    return run_dir / "checkpoints" / "latest"


def forward(moetrain, ckpt, out):
    run([moetrain, "forward", "--checkpoint", ckpt, "--input", TEXT, "--out", out, "--backward"])
    ours = load_file(str(out))
    expected = list(TEXT.encode("utf-8"))
    if ours["tokens"].tolist() != expected:
        raise Mismatch(f"moetrain forward tokenised the text as {ours['tokens'].tolist()}, "
                       f"expected its UTF-8 bytes {expected}")
    return ours


def load_hf(ckpt):
    model, info = MixtralForCausalLM.from_pretrained(
        ckpt, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(key):
            raise Mismatch(f"{ckpt}: transformers reports {key} {info[key]}")
    model.eval()  # no dropout, no router jitter
    return model


def check(what, diff, scale, tol):
    rel = diff / scale
    print(f"  {what}: max |diff| {diff:.3e} (scale {scale:.3e}, relative {rel:.2e}, tolerance {tol:.0e})")
    if not rel <= tol:  # also catches NaN
        raise Mismatch(f"{what}: relative difference {rel:.3e} exceeds {tol:.0e}")
    return rel


def check_logits(ours, logits):
    diff = (logits - ours["logits"]).abs().max().item()
    return check("logits", diff, max(1.0, logits.abs().max().item()), LOGITS_TOL)


def check_loss(what, ours_value, theirs_value):
    diff = abs(ours_value - theirs_value)
    print(f"  {what}: moetrain {ours_value:.7f}, torch {theirs_value:.7f}")
    return check(what, diff, max(1.0, abs(theirs_value)), LOSS_TOL)


def check_grads(ours, model):
    """Every parameter's gradient, relative to that tensor's largest gradient."""
    names = {n for n, _ in model.named_parameters()}
    ours_names = {n for n in ours if n not in ("tokens", "logits") and not n.startswith("loss")}
    if names != ours_names:
        raise Mismatch(f"parameter names differ: only in transformers {sorted(names - ours_names)}, "
                       f"only in moetrain {sorted(ours_names - names)}")
    worst, worst_name, global_diff, global_scale = 0.0, "", 0.0, 0.0
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        mine = ours[name]
        if mine.shape != g.shape:
            raise Mismatch(f"{name}: gradient shape {tuple(mine.shape)}, transformers {tuple(g.shape)}")
        diff = (mine - g).abs().max().item()
        scale = g.abs().max().item()
        global_diff, global_scale = max(global_diff, diff), max(global_scale, scale)
        # A tensor with no gradient in torch (an expert no token chose) must have none in ours.
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if not rel <= worst:
            worst, worst_name = rel, name
        if not rel <= GRAD_TOL:
            raise Mismatch(f"gradient of {name}: max |diff| {diff:.3e} against max |grad| {scale:.3e} "
                           f"(relative {rel:.3e} > {GRAD_TOL:.0e})")
    print(f"  gradients of {len(names)} tensors: worst per-tensor relative difference {worst:.2e} "
          f"({worst_name}); over all, max |diff| {global_diff:.3e} against max |grad| {global_scale:.3e} "
          f"(tolerance {GRAD_TOL:.0e} per tensor)")
    return worst


def router_margin(router_logits, k):
    """Smallest gap between the k-th and (k+1)-th router logit: how close a routing tie came."""
    gaps = []
    for l in router_logits:
        top = torch.topk(l, min(k + 1, l.shape[-1]), dim=-1).values
        if top.shape[-1] > k:
            gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps) if gaps else math.inf


def our_balance_losses(router_logits, k):
    """moetrain's definitions (src/moe/balance.h), per MoE layer, then averaged over layers:
    aux = E · Σ_i f_i · P_i with f_i = top-k selections of expert i / (N·k) and P_i the mean
    router probability; z = mean over tokens of logsumexp(logits)²."""
    aux, z = [], []
    for l in router_logits:
        n, e = l.shape
        p = torch.softmax(l, dim=-1)
        sel = torch.topk(l, k, dim=-1).indices
        f = torch.zeros(e).index_add_(0, sel.reshape(-1), torch.ones(n * k)) / (n * k)
        aux.append(e * (f * p.mean(dim=0)).sum())
        z.append((torch.logsumexp(l, dim=-1) ** 2).mean())
    return torch.stack(aux).mean(), torch.stack(z).mean()


def test_ce_run(moetrain, scratch):
    print("run 'ce' (aux_loss_coef = z_loss_coef = 0): transformers' own loss and gradients")
    ckpt = train(moetrain, scratch, "ce", ["model.aux_loss_coef=0", "model.z_loss_coef=0"])
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("architectures") != ["MixtralForCausalLM"] or cfg.get("model_type") != "mixtral":
        raise Mismatch(f"{ckpt}/config.json: a Mixtral-compatible model must claim MixtralForCausalLM / "
                       f"mixtral, got {cfg.get('architectures')} / {cfg.get('model_type')}")
    ours = forward(moetrain, ckpt, scratch / "ce_out.safetensors")
    model = load_hf(ckpt)
    ids = ours["tokens"].long()[None]
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    print(f"  router: smallest top-{model.config.num_experts_per_tok} margin "
          f"{router_margin(out.router_logits, model.config.num_experts_per_tok):.2e}")
    res = {"logits": check_logits(ours, out.logits[0].detach())}
    # With output_router_logits transformers adds its own aux loss times router_aux_loss_coef,
    # which is 0 here: out.loss is its plain next-token cross-entropy.
    res["loss_ce"] = check_loss("cross-entropy", ours["loss_ce"].item(), out.loss.item())
    check_loss("total loss (coefficients 0)", ours["loss"].item(), out.loss.item())
    out.loss.backward()
    res["grads"] = check_grads(ours, model)
    return res


def test_balance_run(moetrain, scratch):
    aux_coef, z_coef = 0.5, 0.05  # large, so the balancing terms' gradients are a visible share
    print(f"run 'balance' (aux_loss_coef = {aux_coef}, z_loss_coef = {z_coef}): our balancing losses in torch")
    ckpt = train(moetrain, scratch, "balance", [f"model.aux_loss_coef={aux_coef}", f"model.z_loss_coef={z_coef}"])
    ours = forward(moetrain, ckpt, scratch / "balance_out.safetensors")
    model = load_hf(ckpt)
    k, e = model.config.num_experts_per_tok, model.config.num_local_experts
    ids = ours["tokens"].long()[None]
    out = model(input_ids=ids, output_router_logits=True)
    print(f"  router: smallest top-{k} margin {router_margin(out.router_logits, k):.2e}")
    res = {"logits": check_logits(ours, out.logits[0].detach())}
    ce = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    aux, z = our_balance_losses(out.router_logits, k)
    res["loss_ce"] = check_loss("cross-entropy", ours["loss_ce"].item(), ce.item())
    res["loss_aux"] = check_loss("aux loss", ours["loss_aux"].item(), aux.item())
    res["loss_z"] = check_loss("z-loss", ours["loss_z"].item(), z.item())
    total = ce + aux_coef * aux + z_coef * z
    check_loss("total loss", ours["loss"].item(), total.item())

    # transformers' own balancing loss pools the tokens of all layers before taking f·P and
    # counts f over N tokens rather than N·k selections. Recomputed from its definition here so
    # the documented relation (one layer: transformers' = k · ours) stays true of this release.
    theirs = load_balancing_loss_func(out.router_logits, e, k).item()
    pooled, _ = our_balance_losses([torch.cat(out.router_logits, dim=0)], k)
    print(f"  transformers' load_balancing_loss_func {theirs:.6f} = k · (ours over the pooled layers) "
          f"{k * pooled.item():.6f}; ours (mean over layers) {aux.item():.6f}")
    check("transformers' aux = k · pooled ours", abs(theirs - k * pooled.item()), max(1.0, abs(theirs)), LOSS_TOL)

    total.backward()
    res["grads"] = check_grads(ours, model)
    return res


def test_sharded_run(moetrain, scratch):
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("run 'sharded': skipped, no mpiexec on PATH")
        return None
    print("run 'sharded' (2 processes, expert parallel): transformers reads the sharded checkpoint")
    # Each process writes its own model shard; the global batch is the single-process runs'.
    ckpt = train(moetrain, scratch, "sharded",
                 ["model.aux_loss_coef=0", "model.z_loss_coef=0", "train.batch_size=2", "dist.ep=2"],
                 launcher=[mpiexec, "-n", "2", "--oversubscribe", "--allow-run-as-root"])
    index = ckpt / "model.safetensors.index.json"
    if not index.is_file() or (ckpt / "model.safetensors").exists():
        raise Mismatch(f"{ckpt}: two writers must leave model-0000i-of-00002.safetensors shards and "
                       f"{index.name}, not a single model.safetensors")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    print(f"  shards: {', '.join(shards)}")
    if shards != ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]:
        raise Mismatch(f"{index}: weight_map names {shards}")
    ours = forward(moetrain, ckpt, scratch / "sharded_out.safetensors")
    model = load_hf(ckpt)
    ids = ours["tokens"].long()[None]
    out = model(input_ids=ids, labels=ids)
    res = {"logits": check_logits(ours, out.logits[0].detach())}
    res["loss_ce"] = check_loss("cross-entropy", ours["loss_ce"].item(), out.loss.item())
    out.loss.backward()
    res["grads"] = check_grads(ours, model)
    return res


def test_shared_run(moetrain, scratch):
    print("run 'shared' (a shared expert, moetrain-only): config.json must not claim Mixtral")
    ckpt = train(moetrain, scratch, "shared", ["model.shared_expert_hidden=32", "train.steps=1"])
    cfg = json.loads((ckpt / "config.json").read_text())
    arch, mtype, note = cfg.get("architectures"), cfg.get("model_type"), cfg.get("moetrain_note", "")
    print(f"  architectures {arch}, model_type {mtype!r}, moetrain_note {note!r}")
    if arch != ["MoetrainForCausalLM"] or mtype != "moetrain" or "shared expert" not in note:
        raise Mismatch(f"{ckpt}/config.json claims {arch} / {mtype!r} with note {note!r}: a model with a "
                       "shared expert must say MoetrainForCausalLM / 'moetrain' and why")
    try:
        AutoConfig.from_pretrained(ckpt)
    except ValueError as e:
        print(f"  AutoConfig refuses it: {str(e).splitlines()[0][:100]}")
    else:
        raise Mismatch(f"transformers' AutoConfig accepted {ckpt}, which is not a Mixtral model")
    # Forced through MixtralForCausalLM it would drop the shared expert: the weights it cannot
    # place are exactly what makes the model moetrain-only.
    transformers.logging.set_verbosity_error()
    _, info = MixtralForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    transformers.logging.set_verbosity_warning()
    unused = info["unexpected_keys"]
    if not unused or not all("shared_expert" in k for k in unused):
        raise Mismatch(f"expected only the shared expert's weights to be unusable by Mixtral, got {unused}")
    print(f"  forced into MixtralForCausalLM, {len(unused)} tensors would be dropped (e.g. {unused[0]})")


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    moetrain, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    if not moetrain.is_file():
        print(f"FAIL: no moetrain binary at {moetrain}", file=sys.stderr)
        return 1
    if not CORPUS.is_file():
        print(f"FAIL: {CORPUS} is missing: install Debian's fortunes-min (scripts/setup.sh does)", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    corpus = scratch / "corpus.txt"
    corpus.write_bytes(CORPUS.read_bytes()[:8192])
    try:
        run([moetrain, "prepare", "--input", corpus, "--out", scratch / "data"])
        test_ce_run(moetrain, scratch)
        test_balance_run(moetrain, scratch)
        test_sharded_run(moetrain, scratch)
        test_shared_run(moetrain, scratch)
    except Mismatch as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print("PASS: moetrain checkpoints compute in transformers what they compute in moetrain")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
