#!/usr/bin/env bash
# Installs what building, testing and benchmarking Bunshin need: Debian packages, then the
# Python build requirements. Idempotent; safe to run on every `make`.
set -euo pipefail
APT_PKGS=(
  build-essential cmake pkg-config        # the compiled core and C test victims
  bash coreutils procps util-linux iproute2
  btrfs-progs                             # the state file system: O(1) snapshots of upper layers
  python3                                 # Debian's python3: the default rootfs runs it
  busybox-static                          # tiny runnable roots for rootfs tests
  xz-utils zstd                           # compressed rootfs archives
  mmdebstrap debootstrap                  # `bunshin rootfs debian`
  redis-server redis-tools                # a real server forked in tests
  python3-pip curl git                    # bench/workloads run inside workspaces (tests/test_workloads.py)
  xvfb x11-apps xdotool libx11-dev libxext-dev  # an X display (and a MIT-SHM client) forked in tests
  podman runc                             # real containers: bench/e2e.py's baseline (tests/test_podman_baseline.py)
  # Bunshin's patched CRIU is built from Debian's source (bunshin/criu_build.py BUILD_DEPS)
  protobuf-c-compiler libprotobuf-c-dev protobuf-compiler libprotobuf-dev libnl-3-dev libnet1-dev
  libcap-dev uuid-dev libbsd-dev libnftables-dev libgnutls28-dev patch
)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
PY=${PY:-python3}
"$PY" -m pip install -q --disable-pip-version-check \
  "scikit-build-core>=0.10" "cython>=3.0" "cython-cmake>=0.2" 2>&1 | grep -v "^WARNING: Running pip as" || true
# CRIU (a private stock copy, then Bunshin's patched build) comes after the package is
# installed: `bunshin criu provision --if-needed` in the Makefile's install.
