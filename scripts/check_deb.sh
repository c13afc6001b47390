#!/usr/bin/env bash
# CI step (.ci/run): the Debian package installs and the installed program trains.
#
#   1. `make deb` builds build-deb/moetrain_VERSION_ARCH.deb (no CUDA backend);
#   2. its control fields: Depends computed (oneDNN, Open MPI, ZeroMQ, ...), nothing of CUDA;
#   3. `apt-get install ./build-deb/moetrain_*.deb` (root, or sudo);
#   4. every library the installed /usr/bin/moetrain loads comes from a Debian package (nothing
#      from /usr/local, where the CUDA toolkit lives);
#   5. in a fresh temporary directory, far from the source tree: prepare the fortunes text, train
#      /usr/share/moetrain/configs/demo.toml for 3 steps, and find the checkpoint it wrote;
#   6. remove the package again (on every exit), leaving the machine as it was found.
#
# Needs root or sudo. It refuses to run where a moetrain package is already installed, since step
# 6 would remove it.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deb_dir="$root/${DEB_BUILD_DIR:-build-deb}"
bin=/usr/bin/moetrain

fail() { echo "check_deb: FAIL: $*" >&2; exit 1; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || fail "needs root (or sudo) to install the package"
  SUDO=sudo
fi
if dpkg-query -W -f='${Status}' moetrain 2>/dev/null | grep -q 'install ok installed'; then
  fail "a moetrain package is already installed ($(dpkg-query -W -f='${Version}' moetrain));" \
       "this check would remove it at the end: remove it first (apt-get remove moetrain)"
fi

# 1. The package, built afresh (older versions' files would make the glob ambiguous).
rm -f "$deb_dir"/moetrain_*.deb
make -C "$root" deb DEB_BUILD_DIR="$deb_dir"
shopt -s nullglob
debs=("$deb_dir"/moetrain_*.deb)
shopt -u nullglob
[ ${#debs[@]} -eq 1 ] || fail "expected one moetrain_*.deb in $deb_dir, found ${#debs[@]}: ${debs[*]:-none}"
deb="${debs[0]}"
echo "check_deb: $deb ($(du -h "$deb" | cut -f1))"

# 2. Control fields.
dpkg-deb -I "$deb"
depends="$(dpkg-deb -f "$deb" Depends)"
[ -n "$depends" ] || fail "the package has no Depends (dpkg-shlibdeps did not run?)"
if grep -qiE 'cuda|cublas|nvidia' <<<"$depends"; then
  fail "Depends names CUDA, which no plain Debian machine has: $depends"
fi
for lib in libdnnl libopenmpi libzmq libfmt libtomlplusplus libsentencepiece libzstd libc6 libstdc++6; do
  grep -q "$lib" <<<"$depends" || fail "Depends lacks $lib: $depends"
done
[ "$(dpkg-deb -f "$deb" Package)" = moetrain ] || fail "package name is not moetrain"
contents="$(dpkg-deb -c "$deb")"
for f in ./usr/bin/moetrain ./usr/share/moetrain/configs/demo.toml \
         ./usr/share/doc/moetrain/README.md ./usr/share/doc/moetrain/docs/README.md; do
  grep -q " $f\$" <<<"$contents" || fail "the package lacks $f"
done

# 3. Install; from here on, whatever happens, the package is removed again.
work="$(mktemp -d)"
cleanup() {
  local rc=$?
  echo "check_deb: removing the package"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq -o DPkg::Lock::Timeout=300 moetrain \
    >/dev/null || { echo "check_deb: FAIL: apt-get remove moetrain failed" >&2; rc=1; }
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
before="$(dpkg-query -W -f='${Package}\n' | sort)"
# --no-install-recommends: the demo corpus (fortunes) is already here (scripts/setup.sh), and
# packages apt pulled in would stay behind after the removal.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  -o DPkg::Lock::Timeout=300 "$deb" || fail "apt-get install $deb failed"
added="$(comm -13 <(echo "$before") <(dpkg-query -W -f='${Package}\n' | sort) | grep -vx moetrain || true)"
[ -z "$added" ] || echo "check_deb: note: apt also installed (left installed): $added"
[ -x "$bin" ] || fail "$bin is missing after the install"

# 4. Every library the installed binary loads belongs to a Debian package.
ldd_out="$(env -u LD_LIBRARY_PATH ldd "$bin")"
! grep -q 'not found' <<<"$ldd_out" || fail "$bin misses libraries: $(grep 'not found' <<<"$ldd_out")"
while read -r path; do
  real="$(readlink -f "$path")"
  dpkg -S "$path" >/dev/null 2>&1 || dpkg -S "$real" >/dev/null 2>&1 ||
    fail "$bin loads $path, which no Debian package provides"
done < <(awk '/=> \// { print $3 }' <<<"$ldd_out")

# 5. Train the demo config from a directory that is not the source tree. The config's data.dir
#    (data/fortunes) is relative to the working directory.
cd "$work"
env -u LD_LIBRARY_PATH "$bin" version
env -u LD_LIBRARY_PATH "$bin" prepare --input /usr/share/games/fortunes --out data/fortunes
env -u LD_LIBRARY_PATH "$bin" train --config /usr/share/moetrain/configs/demo.toml --steps 3 \
  --run-dir runs/deb
shopt -s nullglob
manifests=(runs/deb/checkpoints/step_*/manifest.json)
shopt -u nullglob
[ ${#manifests[@]} -ge 1 ] || fail "training wrote no checkpoint under $work/runs/deb/checkpoints"
ckpt=runs/deb/checkpoints/step_00000003
[ -f "$ckpt/manifest.json" ] && [ -f "$ckpt/model.safetensors" ] ||
  fail "no complete checkpoint of step 3 ($ckpt); found: ${manifests[*]}"
echo "check_deb: OK: the installed moetrain trained 3 steps in $work and wrote $ckpt"
