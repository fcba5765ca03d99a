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
  protobuf-c-compiler libprotobuf-c-dev protobuf-compiler libnl-3-dev libnet1-dev libcap-dev
  libbsd-dev libnftables-dev libgnutls28-dev patch
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
# protobuf: pycriu, through which Bunshin drives CRIU, needs it (the `criu` extra) already for
# the check below
"$PY" -m pip install -q --disable-pip-version-check \
  "scikit-build-core>=0.10" "cython>=3.0" "cython-cmake>=0.2" "protobuf>=4" 2>&1 | grep -v "^WARNING: Running pip as" || true
# A CRIU >= 4 for bunshin.criu and its tests (Debian 12's 3.17 fails on kernels >= 6.13): a
# private copy of Debian testing's packages into ~/.cache/bunshin/criu (stock, and the pycriu
# Bunshin drives CRIU with), then Bunshin's CRIU built from Debian's source with criu/patches
# into ~/.cache/bunshin/criu-bunshin (`bunshin criu provision`; apt's configuration is left
# alone). A failed build fails the install: the tests would otherwise run on the stock CRIU.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if ! PYTHONPATH="$ROOT" "$PY" -c 'import sys; from bunshin.criu_locate import inspect_criu, private_prefix; p = private_prefix() / "bin" / "criu"; sys.exit(0 if p.is_file() and inspect_criu(p, "private").usable else 1)' 2>/dev/null; then
  echo "install-deps: provisioning a private CRIU 4 (bunshin criu provision)" >&2
  PYTHONPATH="$ROOT" "$PY" -c 'from bunshin.criu_locate import provision_criu; print(provision_criu().reason)' >&2 \
    || echo "install-deps: CRIU provisioning failed; tests/test_criu.py will be skipped" >&2
fi
if PYTHONPATH="$ROOT" "$PY" -c 'import sys; from bunshin.criu_locate import private_prefix; sys.exit(0 if (private_prefix() / "bin" / "criu").is_file() else 1)' \
   && ! PYTHONPATH="$ROOT" "$PY" -c 'import sys; from bunshin.criu_build import is_current; sys.exit(0 if is_current() else 1)'; then
  echo "install-deps: building Bunshin's CRIU (criu/patches) from Debian's source" >&2
  PYTHONPATH="$ROOT" "$PY" -c 'from bunshin.criu_build import build_criu; i = build_criu(); print(i.path, i.patches, i.reason)' >&2
fi
