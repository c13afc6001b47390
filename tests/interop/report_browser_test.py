"""The run report of a short real run, rendered by a real browser (headless Chromium).

Usage: report_browser_test.py MOETRAIN_BINARY SCRATCH_DIR

Trains a tiny model with the real `moetrain` binary, writes `moetrain report`, then has Chromium
(Debian package chromium) load the file: once dumping the DOM it built, which must hold one
<svg class="chart"> per chart section, as many polyline points as metrics.jsonl has steps, a
marker on each validation point, a unit on each chart's y axis (the loss in nats/byte, as `train`
prints it) and the run header (version, processes, CPU, start, wall time), and
once taking a screenshot (SCRATCH_DIR/report.png, to look at) with console logging on, which must
show no console message (a script error, a blocked fetch, a malformed SVG).

Exits non-zero naming what is wrong.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2]
CORPUS = Path("/usr/share/games/fortunes/fortunes")  # Debian package fortunes-min
STEPS = 12
TINY = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
    "model.expert_hidden=32", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=32",
    f"train.steps={STEPS}", "train.batch_size=2", "train.seq_len=32", "train.eval_batches=1",
    "train.eval_every=4", "train.checkpoint_every=6", "train.progress=off",
]
CHARTS = ["loss", "grad-norm", "lr", "throughput", "expert-load", "expert-load-steps", "imbalance",
          "utilisation", "time"]
# Section -> the y-axis label its chart must carry.
UNITS = {"loss": "loss (nats/byte)", "grad-norm": "L2 norm", "throughput": "tokens/s",
         "time": "time (s)", "imbalance": "ratio (max / mean)", "utilisation": "fraction (0 to 1)"}
HEADER = ["moetrain", "run", "processes", "device", "CPU", "started", "wall time", "time in steps",
          "settings"]


def run(cmd, **kw):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        sys.exit(f"FAIL: command failed ({res.returncode}): {' '.join(map(str, cmd))}\n"
                 f"{res.stdout}{res.stderr}")
    return res


def chromium():
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return name
    sys.exit("FAIL: no chromium on PATH (Debian package chromium; scripts/setup.sh --tests)")


def main():
    moetrain, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    run_dir = scratch / "run"
    run([moetrain, "prepare", "--input", CORPUS, "--out", scratch / "data"])
    cmd = [moetrain, "train", "--config", SOURCE_DIR / "configs" / "tiny.toml"]
    for s in TINY + [f"train.run_dir={run_dir}", f"data.dir={scratch / 'data'}"]:
        cmd += ["--set", s]
    run(cmd)
    (run_dir / "sample.txt").write_text("A <sample> & its text\n")
    report = scratch / "report.html"
    run([moetrain, "report", run_dir, "--out", report])

    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = sum(1 for l in lines if "loss" in l)
    val_steps = sum(1 for l in lines if "val_loss" in l)
    if train_steps != STEPS:
        sys.exit(f"FAIL: metrics.jsonl has {train_steps} training lines, expected {STEPS}")

    browser = chromium()
    common = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--window-size=1200,3000",
              "--user-data-dir=" + str(scratch / "profile")]
    dom = run(common + ["--dump-dom", report.as_uri()], timeout=120).stdout
    sections = re.findall(r'<section id="([^"]+)">(.*?)</section>', dom, re.S)
    by_id = dict(sections)
    for chart in CHARTS:
        body = by_id.get(chart)
        if body is None:
            sys.exit(f"FAIL: the rendered DOM has no section {chart!r}")
        if body.count('<svg class="chart"') != 1 or body.count("<h2>") != 1:
            sys.exit(f"FAIL: section {chart!r} should hold one <h2> and one svg.chart")
    points = [len(p.split()) for p in re.findall(r'points="([^"]*)"', by_id["loss"])]
    if points != [train_steps, val_steps]:
        sys.exit(f"FAIL: loss polylines have {points} points, expected {[train_steps, val_steps]}")
    points = [len(p.split()) for p in re.findall(r'points="([^"]*)"', by_id["lr"])]
    if points != [train_steps]:
        sys.exit(f"FAIL: learning-rate polyline has {points} points, expected [{train_steps}]")
    markers = by_id["loss"].count('class="marker"')
    if markers != val_steps:
        sys.exit(f"FAIL: the loss chart marks {markers} validation points, expected {val_steps}")
    for sec, unit in UNITS.items():
        labels = re.findall(r'<text[^>]*rotate\(-90[^>]*>([^<]*)</text>', by_id[sec])
        if labels != [unit]:
            sys.exit(f"FAIL: section {sec!r} has y-axis labels {labels}, expected [{unit!r}]")
    header = re.search(r'<table class="header" id="run-header">(.*?)</table>', dom, re.S)
    if header is None or dom.find('id="run-header"') > dom.find("<section"):
        sys.exit("FAIL: no run header above the sections")
    rows = dict(re.findall(r"<th>([^<]*)</th><td>([^<]*)</td>", header.group(1)))
    if list(rows) != HEADER:
        sys.exit(f"FAIL: the run header has rows {list(rows)}, expected {HEADER}")
    version = run([moetrain, "version"]).stdout.split("\n")[0].split()[1]
    if not rows["moetrain"].startswith(version) or not rows["processes"].startswith("1 process"):
        sys.exit(f"FAIL: the run header says {rows}; expected moetrain {version}, 1 process")
    if "&lt;sample&gt; &amp; its text" not in by_id.get("sample", ""):
        sys.exit("FAIL: the sample text is missing or not escaped in the rendered DOM")

    png = scratch / "report.png"
    shot = run(common + ["--enable-logging=stderr", "--v=0", f"--screenshot={png}",
                         report.as_uri()], timeout=120)
    console = [l for l in shot.stderr.splitlines() if "CONSOLE" in l]
    if console:
        sys.exit("FAIL: console messages while rendering the report:\n" + "\n".join(console))
    if not png.is_file() or png.stat().st_size < 10000:
        sys.exit(f"FAIL: no screenshot at {png}")
    print(f"ok: {len(sections)} sections, {train_steps} steps; screenshot {png}")


if __name__ == "__main__":
    main()
