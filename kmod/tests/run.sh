#!/bin/bash
# run.sh - test bunshin.ko in a real kernel, in one command.
#
# Builds the module on the host against the newest Debian 6.1 cloud kernel
# apt serves, boots that kernel under QEMU/TCG with the host root shared
# read-only (virtio-fs), loads the module, runs guest-tests.sh (pytest suite
# + benchmark), unloads it and checks the kernel log.
#
# usage: kmod/tests/run.sh [-t SECS] [-m MiB] [-o OUTDIR] [-f TESTS] [-x CMD] [-- PYTEST_ARGS...]
#   -t SECS   wall-clock limit for the guest (default 1500: a hang guard; a run
#             takes ~6-9 min, more when the host is slowed by its neighbours)
#   -m MiB    guest memory (default 1024)
#   -o DIR    results directory (default: a new run dir in the cache)
#   -f TESTS  the library's tests to run in the guest with the module as backend
#             (pytest node ids, space-separated, from the repository root;
#             default: tests/test_kmod_backend.py tests/test_cloners.py tests/test_fork.py
#             tests/test_fork_failures.py tests/test_fork_comm.py
#             tests/test_fork_tcp.py tests/test_fork_seccomp.py tests/test_fork_keeper.py
#             tests/test_fork_vfork.py tests/test_fork_stopped.py tests/test_fork_source.py
#             tests/fidelity;
#             "none" skips)
#   -x CMD    run this shell command in the guest instead of the tests and benchmarks
#             (from the repository root, with the module loaded and what the fork suite
#             has: a cgroup hierarchy, BUNSHIN_STATE_DIR; its output goes to output.log,
#             its status is the run's): profiling, one test under the module
# env: BUNSHIN_CACHE_DIR (default ~/.cache/bunshin; kernels live in its kmod/),
#      BUNSHIN_KVER (skip resolution), BUNSHIN_GUEST_PYTHON (needs pytest, numpy)
# Exit: 0 all passed; 1 a test failed; 124 timeout; 125 harness failure;
#       126 insmod/rmmod failed or the kernel logged BUG/WARNING/Oops.
# Results: OUTDIR/{output.log,junit.xml,junit-fork.xml,junit-sandbox.xml,bench.log,dmesg.txt,console.log,rc}
set -euo pipefail

TESTS=$(cd "$(dirname "$0")" && pwd)
KMOD=$(dirname "$TESTS")
CACHE=${BUNSHIN_CACHE_DIR:-$HOME/.cache/bunshin}/kmod
PY=${BUNSHIN_GUEST_PYTHON:-/root/.pyenv/versions/3.11.7/bin/python3}
QEMU=qemu-system-x86_64
VIRTIOFSD=/usr/lib/qemu/virtiofsd
TIMEOUT=1500 MEM=1024 OUT= FORK_TESTS= GUEST_CMD=
while getopts "t:m:o:f:x:h" o; do
  case $o in
    t) TIMEOUT=$OPTARG;; m) MEM=$OPTARG;; o) OUT=$OPTARG;; f) FORK_TESTS=$OPTARG;; x) GUEST_CMD=$OPTARG;;
    *) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 125;;
  esac
done
shift $((OPTIND - 1))
log() { printf '[%(%T)T] %s\n' -1 "$*" >&2; }
die() { log "$*"; exit 125; }
T0=$SECONDS
mkdir -p "$CACHE"

# --- cleanup on every exit path: daemons, sockets, staging dirs ---------------
pgids=() scratch=()
cleanup() {
  local p i
  # newest first: qemu goes before the virtiofsd daemons it talks to
  for ((i = ${#pgids[@]} - 1; i >= 0; i--)); do kill -TERM -- "-${pgids[i]}" 2>/dev/null || true; done
  [ ${#pgids[@]} = 0 ] || sleep 0.2
  for p in "${pgids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ ${#scratch[@]} = 0 ] || rm -rf "${scratch[@]}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# --- host packages ---------------------------------------------------------
apt_fresh=0
apt_update() {
  [ $apt_fresh = 1 ] && return
  log "apt-get update"; apt-get update -qq >&2; apt_fresh=1
}
apt_install() {
  apt_update
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}
# lists older than a day may not know the newest kernel
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
  apt_update
fi

candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}'; }
# Newest N whose linux-headers-6.1.0-N-cloud-amd64 and image (signed, or the
# -unsigned one: the same kernel, and QEMU does not check signatures) have the
# same candidate version, so the module is built for exactly that kernel.
resolve_kernel() {
  local k hv pkg
  for k in $(apt-cache search --names-only '^linux-headers-6\.1\.0-[0-9]+-cloud-amd64$' \
             | awk '{print $1}' | sed 's/^linux-headers-//' | sort -rV); do
    hv=$(candidate "linux-headers-$k")
    [ -n "$hv" ] && [ "$hv" != "(none)" ] || continue
    for pkg in "linux-image-$k" "linux-image-$k-unsigned"; do
      [ "$(candidate "$pkg")" = "$hv" ] && { echo "$k $pkg"; return; }
    done
  done
}
if [ -n "${BUNSHIN_KVER:-}" ]; then
  KVER=$BUNSHIN_KVER IMAGE_PKG=linux-image-$KVER
else
  read -r KVER IMAGE_PKG <<<"$(resolve_kernel)" || true
  [ -n "${KVER:-}" ] || die "apt serves no linux-image-6.1.0-*-cloud-amd64 with matching headers"
fi
log "guest kernel $KVER ($IMAGE_PKG)"

need=()
command -v "$QEMU" >/dev/null || need+=(qemu-system-x86)
[ -x "$VIRTIOFSD" ] || need+=(qemu-system-common)
case $(ldd /bin/busybox 2>&1) in *"not a dynamic"*) ;; *) need+=(busybox-static);; esac
[ -e "/lib/modules/$KVER/build/Makefile" ] || need+=("linux-headers-$KVER")
command -v gcc-12 >/dev/null || need+=(gcc-12)
command -v make >/dev/null || need+=(make)
[ ${#need[@]} = 0 ] || apt_install "${need[@]}"
"$PY" -c 'import pytest, numpy' 2>/dev/null || die "$PY lacks pytest or numpy"

# --- the guest kernel, extracted once per version ----------------------------
exec 9>"$CACHE/.lock"
flock 9     # one extraction / initramfs build at a time
KDIR=$CACHE/kernel-$KVER
# a private executable copy: the guest's /init runs it, and the host's copy
# may have lost its x bit
BUSYBOX=$CACHE/busybox
cmp -s /bin/busybox "$BUSYBOX" || install -m 0755 /bin/busybox "$BUSYBOX"
if [ ! -e "$KDIR/lib/modules/$KVER/modules.dep" ]; then
  log "downloading $IMAGE_PKG"
  mkdir -p "$CACHE/debs"
  rm -f "$CACHE"/debs/"$IMAGE_PKG"_*.deb
  (cd "$CACHE/debs" && apt-get download -q -o APT::Sandbox::User=root "$IMAGE_PKG" >&2)
  scratch+=("$KDIR.tmp")
  rm -rf "$KDIR.tmp" && mkdir -p "$KDIR.tmp"
  dpkg-deb -x "$CACHE"/debs/"$IMAGE_PKG"_*.deb "$KDIR.tmp"
  "$BUSYBOX" depmod -b "$KDIR.tmp" "$KVER"
  rm -rf "$KDIR" && mv "$KDIR.tmp" "$KDIR"
  rm -f "$CACHE"/debs/"$IMAGE_PKG"_*.deb
fi
# older extracted kernels are dead weight once a newer one is served
for old in "$CACHE"/kernel-* "$CACHE"/initramfs-*.cpio.gz*; do
  case $old in *"$KVER"*) ;; *) [ -e "$old" ] && rm -rf "$old";; esac
done

# --- initramfs: busybox, virtio-fs modules, guest-init.sh --------------------
INITRD=$CACHE/initramfs-$KVER.cpio.gz
# the socket diag modules: the fork engine lists unix and inet sockets through sock_diag;
# loop: a sandbox's rootfs must be idmappable, which on 6.1 takes a block file system (an
# ext4 image, test_sandbox_ext4.py)
MODS="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci fuse virtiofs overlay
      unix_diag inet_diag tcp_diag udp_diag loop"
MODS=$(echo $MODS)
if [ ! -e "$INITRD" ] || [ "$TESTS/guest-init.sh" -nt "$INITRD" ] ||
   [ "$(cat "$INITRD.mods" 2>/dev/null)" != "$MODS" ]; then
  log "building $INITRD"
  S=$(mktemp -d "$CACHE/initramfs.XXXX")
  scratch+=("$S" "$INITRD.tmp")
  mkdir -p "$S"/{bin,dev,proc,sys,lib/modules}
  install -m 0755 "$BUSYBOX" "$S/bin/busybox"
  cp "$TESTS/guest-init.sh" "$S/init"
  echo "$MODS" > "$S/modules.order"
  for m in $MODS; do
    f=$(grep -E "/$m\.ko:" "$KDIR/lib/modules/$KVER/modules.dep" | cut -d: -f1)
    [ -n "$f" ] || die "module $m not in $KVER"
    cp "$KDIR/lib/modules/$KVER/$f" "$S/lib/modules/"
  done
  (cd "$S" && find . | "$BUSYBOX" cpio -o -H newc 2>/dev/null | gzip -1) > "$INITRD.tmp"
  mv "$INITRD.tmp" "$INITRD"
  echo "$MODS" > "$INITRD.mods"
  rm -rf "$S"
fi
flock -u 9
exec 9>&-

# --- per-run directory, module build -------------------------------------------
RUN=$CACHE/runs/$(date +%Y%m%d-%H%M%S)-$$
OUT=${OUT:-$RUN/results}
mkdir -p "$RUN/build" "$RUN/sock" "$OUT"
scratch+=("$RUN/build" "$RUN/sock")
OUT=$(realpath "$OUT")
rm -f "$OUT"/{rc,output.log,junit.xml,junit-fork.xml,junit-sandbox.xml,bench.log,dmesg.txt,console.log,pytest.args}
# keep the last few runs for inspection
ls -1d "$CACHE"/runs/*/ 2>/dev/null | head -n -5 | xargs -r rm -rf

log "building bunshin.ko"
cp -r "$KMOD"/Kbuild "$KMOD"/*.c "$KMOD"/*.h "$KMOD"/include "$RUN/build/"
# Debian built the kernel with gcc-12: the same compiler keeps
# CONFIG_CC_VERSION_TEXT identical to the running kernel's.
make -s -C "/lib/modules/$KVER/build" M="$RUN/build" CC=gcc-12 modules >&2 \
  || die "module build failed"
printf 'KO=%q\nTESTS=%q\nPY=%q\nHOSTINFO=%q\nFORK_TESTS=%q\nGUEST_CMD=%q\n' "$RUN/build/bunshin.ko" \
  "$TESTS" "$PY" "$(uname -r) $(nproc) cpus" "$FORK_TESTS" "$GUEST_CMD" > "$OUT/guest.env"
# NUL-separated: quoting survives; none is an empty file (printf would write one empty
# argument, and pytest given "" collects every test file of the directory)
: > "$OUT/pytest.args"
[ $# = 0 ] || printf '%s\0' "$@" > "$OUT/pytest.args"

# --- virtiofsd + qemu --------------------------------
# setsid: each daemon leads its own process group, so cleanup reaches the
# helpers it forks as well
setsid "$VIRTIOFSD" --socket-path="$RUN/sock/root" -o source=/ -o cache=always \
  -o sandbox=chroot -o log_level=err > "$RUN/virtiofsd-root.log" 2>&1 &
pgids+=($!)
setsid "$VIRTIOFSD" --socket-path="$RUN/sock/results" -o source="$OUT" -o cache=none \
  -o sandbox=namespace -o log_level=err > "$RUN/virtiofsd-results.log" 2>&1 &
pgids+=($!)
for s in root results; do
  for _ in $(seq 200); do [ -S "$RUN/sock/$s" ] && break; sleep 0.05; done
  [ -S "$RUN/sock/$s" ] || die "virtiofsd $s did not start (see $RUN/virtiofsd-$s.log)"
done

log "booting $KVER (TCG, ${MEM} MiB); results in $OUT"
setsid "$QEMU" -accel tcg -cpu max -smp 2 -m "$MEM" \
  -object memory-backend-memfd,id=mem,size="${MEM}M",share=on \
  -machine pc,memory-backend=mem \
  -chardev socket,id=vfs0,path="$RUN/sock/root" \
  -device vhost-user-fs-pci,chardev=vfs0,tag=hostroot \
  -chardev socket,id=vfs1,path="$RUN/sock/results" \
  -device vhost-user-fs-pci,chardev=vfs1,tag=results \
  -display none -monitor none -serial stdio -no-reboot \
  -kernel "$KDIR/boot/vmlinuz-$KVER" -initrd "$INITRD" \
  -append "console=ttyS0 panic=-1 quiet" </dev/null > "$OUT/console.log" 2>&1 &
qemu=$!
pgids+=($qemu)
tail -n +1 -f --pid=$qemu "$OUT/console.log" >&2 &
deadline=$((SECONDS + TIMEOUT))
while kill -0 $qemu 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
if kill -0 $qemu 2>/dev/null; then
  log "TIMEOUT after ${TIMEOUT}s"; rc=124
  kill -KILL -- "-$qemu" 2>/dev/null || true
elif [ -s "$OUT/rc" ]; then
  rc=$(cat "$OUT/rc")
else
  log "guest reported no status"; rc=125
fi
wait $qemu 2>/dev/null || true

summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?)' "$OUT/output.log" 2>/dev/null | tail -1 || true)
log "tests: ${summary:-none ran}"
[ -s "$OUT/bench.log" ] && log "bench: $(tail -n 1 "$OUT/bench.log")"
log "rc=$rc in $((SECONDS - T0)) s; results in $OUT"
exit "$rc"
