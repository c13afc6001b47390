#!/usr/bin/env bash
# Installs every dependency moetrain needs on Debian 12. Idempotent: a second run
# installs nothing and finishes in about a second.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libdnnl-dev                       # oneDNN: every GEMM
  ocl-icd-opencl-dev opencl-headers # oneDNN's CMake config asks for OpenCL (its GPU runtime)
  libopenmpi-dev openmpi-bin        # collective distributed mode
  libzmq3-dev cppzmq-dev            # parameter-server transport
  libtomlplusplus-dev               # configs
  libcli11-dev                      # command line
  nlohmann-json3-dev                # safetensors headers, config.json, metrics
  libfmt-dev                        # formatting
  zlib1g-dev                        # gzip IDX files (Fashion-MNIST)
  libgtest-dev googletest           # tests
  libbenchmark-dev                  # benchmarks
  fortunes fortunes-min             # English text corpus for the demo
  dataset-fashion-mnist             # image data for the classifier
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
