#!/usr/bin/env bash
# Installs every dependency moetrain needs on Debian 12. Idempotent: a second run installs
# nothing and finishes in about a second.
#
#   scripts/setup.sh           what building, training and benchmarking need (make demo, make bench)
#   scripts/setup.sh --tests   also what the tests need (make test): the interop test's Python side
#   scripts/setup.sh --peers   also PyTorch 2.x for the peer benchmarks (bench/peers/, run by make bench)
#
# Two parts: Debian packages (apt), then (--tests) a project-local virtualenv (.venv) holding a pinned
# Hugging Face transformers and TensorBoard for the interop tests (tests/interop). The venv sees Debian's
# python3-torch through --system-site-packages, so torch itself is never downloaded by pip.
# Every venv python call runs with -s: a user's ~/.local packages (a numpy 2, say, which Debian's
# torch 1.13 was not built for) must not shadow Debian's.
#
# --peers: a second virtualenv (.venv-bench) with PyTorch 2.x from PyPI, without the system's
# packages (Debian's torch 1.13 must not be the one imported). Only the benchmarks use it;
# scripts/bench.sh runs bench/peers/ with it where it exists and skips them where not. PyPI's
# torch wheel brings the CUDA libraries with it: about 5.4 GB, two minutes on a fast link.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(
  build-essential cmake pkg-config
  ccache                            # rebuilds of sources compiled before (another clone, branch)
  dpkg-dev file                     # make deb: cpack's Depends (dpkg-shlibdeps), which reads ELF types with file
  libdnnl-dev                       # oneDNN: every GEMM
  ocl-icd-opencl-dev opencl-headers # oneDNN's CMake config asks for OpenCL (its GPU runtime)
  libopenmpi-dev openmpi-bin        # collective distributed mode
  libzmq3-dev cppzmq-dev            # parameter-server transport
  libtomlplusplus-dev               # configs
  libcli11-dev                      # command line
  nlohmann-json3-dev                # nlohmann_json: safetensors headers, config.json, metrics
  libfmt-dev                        # formatting
  zlib1g-dev                        # gzip: IDX files (Fashion-MNIST), compressed corpora
  libzstd-dev                       # zstd-compressed corpora
  libsentencepiece-dev              # tokenizers: train and load tokenizer.model (SentencePiece)
  libgtest-dev googletest           # tests
  libbenchmark-dev                  # benchmarks
  fortunes fortunes-min             # English text corpus for the demo
  dataset-fashion-mnist             # image data for the classifier
)
test_packages=(
  python3 python3-venv python3-pip  # the interop test's virtualenv
  python3-torch                     # PyTorch 1.13 (Debian 12): the interop test's reference
  chromium                          # headless browser: renders the run report (interop.report_browser)
)
peer_packages=(
  python3 python3-venv              # the peer benchmarks' virtualenv
  python3-dev                       # torch.compile's C++ kernels include Python.h
)
with_tests=0
with_peers=0
for arg in "$@"; do
  case "$arg" in
    --tests) with_tests=1 ;;
    --peers) with_peers=1 ;;
    *) echo "setup: unknown option '$arg' (known: --tests, --peers)" >&2; exit 2 ;;
  esac
done
[ "$with_tests" = 1 ] && packages+=("${test_packages[@]}")
[ "$with_peers" = 1 ] && packages+=("${peer_packages[@]}")

# transformers' last releases that still support torch 1.13 are 4.4x; these pins are the set
# the interop test was checked with. tokenizers and huggingface-hub are pinned so that pip never
# resolves to a release needing a newer Python or torch. tensorboard is the TensorBoard test's
# reader (EventAccumulator); protobuf is pinned with it because Debian's python3-protobuf is not
# installed, and an unpinned one would resolve to the newest major release. sentencepiece lets
# transformers read a checkpoint's tokenizer.model (the tokenizer interop test).
venv="$root/.venv"
python_pins=(transformers==4.40.2 tokenizers==0.19.1 huggingface-hub==0.23.4 safetensors==0.4.3
             tensorboard==2.16.2 protobuf==4.25.3 sentencepiece==0.2.0)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} Debian packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    SUDO=sudo
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# pins_present VENV PIN...: checked by installed metadata; nothing to do when every one is there.
pins_present() {
  local py="$1/bin/python"
  shift
  [ -x "$py" ] || return 1
  "$py" -s - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}

# The peer benchmarks' PyTorch (the version docs/PERF.md's figures were measured with).
peer_venv="$root/.venv-bench"
peer_pins=(torch==2.15.0 numpy==2.4.6)
if [ "$with_peers" = 1 ]; then
  if pins_present "$peer_venv" "${peer_pins[@]}"; then
    echo "setup: $peer_venv has ${peer_pins[*]}"
  else
    [ -x "$peer_venv/bin/python" ] || /usr/bin/python3 -m venv "$peer_venv"
    echo "setup: pip installing ${peer_pins[*]} into $peer_venv"
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$peer_venv/bin/python" -s -m pip install -q --no-input \
      --prefer-binary "${peer_pins[@]}"
    pins_present "$peer_venv" "${peer_pins[@]}" ||
      { echo "setup: $peer_venv still lacks one of ${peer_pins[*]}" >&2; exit 1; }
    "$peer_venv/bin/python" -s -c 'import torch, numpy' ||
      { echo "setup: torch / numpy do not import in $peer_venv" >&2; exit 1; }
  fi
fi

if [ "$with_tests" = 0 ]; then
  echo "setup: done"
  exit 0
fi

if pins_present "$venv" "${python_pins[@]}"; then
  echo "setup: $venv has ${python_pins[*]}"
else
  # Always Debian's interpreter: torch comes from its dist-packages, whatever python3 is on PATH.
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
  fi
  echo "setup: pip installing ${python_pins[*]} into $venv"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/python" -s -m pip install -q --no-input --prefer-binary \
    "${python_pins[@]}"
  pins_present "$venv" "${python_pins[@]}" || { echo "setup: $venv still lacks one of ${python_pins[*]}" >&2; exit 1; }
  "$venv/bin/python" -s -c 'import torch, transformers, safetensors
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator' ||
    { echo "setup: torch / transformers / safetensors / tensorboard do not import in $venv" >&2; exit 1; }
fi
echo "setup: done"
