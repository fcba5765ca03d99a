#!/bin/bash
# Runs inside the QEMU guest (chroot of the host root) once bunshin.ko is
# loaded: the module's pytest suite, the library's fork suite (with the module
# as its backend: exact parent links), then the benchmarks; exit 0 only if all
# pass.
set -u -o pipefail
cd "$(dirname "$0")"
TESTS=$PWD
REPO=$(cd ../.. && pwd)
PY=${BUNSHIN_GUEST_PYTHON:?}
args=()
[ -s "$RESULTS_DIR/pytest.args" ] && mapfile -d '' args < "$RESULTS_DIR/pytest.args"
rc=0
FORK_TESTS= GUEST_CMD=
. "$RESULTS_DIR/guest.env"   # run.sh -f, -x

# Workspaces here are trusted ones: a sandbox (the default) cannot be made on the guest's own
# root. Its root is built by overlayfs on idmapped views of the rootfs's layers, and on 6.1 the
# guest's root (an overlay on virtio-fs) and its tmpfs cannot be idmapped;
# test_sandbox_ext4.py makes one on an ext4 image's rootfs.
export BUNSHIN_ISOLATION=trusted

# The library's own suite needs what a host has: a cgroup hierarchy and a
# state directory on a file system of its own (a tmpfs here, so no loop device).
mountpoint -q /sys/fs/cgroup || mount -t cgroup2 cgroup2 /sys/fs/cgroup || rc=1
mkdir -p /run/bunshin-state && mount -t tmpfs -o mode=700 bunshin-state /run/bunshin-state || rc=1
if [ -n "$GUEST_CMD" ]; then   # run.sh -x: that command alone
  [ $rc = 0 ] || exit $rc
  cd "$REPO" && BUNSHIN_STATE_DIR=/run/bunshin-state BUNSHIN_CACHE_DIR=/run/tmp/bunshin-cache \
    PY="$PY" exec /bin/bash -c "$GUEST_CMD"
fi
"$PY" -m pytest -p no:cacheprovider -q -rfE --durations=5 --junitxml="$RESULTS_DIR/junit.xml" \
    test_kmod.py test_fork_verb.py test_run_verb.py test_session_verb.py "${args[@]}" || rc=1

# a sandbox on 6.1, its layers' views attached (runtime/userns.py), on an ext4 image's rootfs,
# forked by the module
(cd "$REPO" && BUNSHIN_KMOD=1 BUNSHIN_STATE_DIR=/run/bunshin-state BUNSHIN_CACHE_DIR=/run/tmp/bunshin-cache \
   "$PY" -m pytest -p no:cacheprovider -q -rfE --junitxml="$RESULTS_DIR/junit-sandbox.xml" \
     kmod/tests/test_sandbox_ext4.py) || rc=1

read -r -a fork_tests <<< "${FORK_TESTS:-tests/test_kmod_backend.py tests/test_cloners.py tests/test_fork.py tests/test_fork_failures.py tests/test_fork_comm.py tests/test_fork_tcp.py tests/test_fork_seccomp.py tests/test_fork_keeper.py tests/test_fork_vfork.py tests/test_fork_stopped.py tests/test_fork_source.py tests/fidelity}"
if [ "${fork_tests[*]}" != none ]; then
  # the fidelity suite's outcomes: the fork table's "child (module)" column (tests/fidelity/table.py)
  (cd "$REPO" && BUNSHIN_KMOD=1 BUNSHIN_STATE_DIR=/run/bunshin-state \
     BUNSHIN_CACHE_DIR=/run/tmp/bunshin-cache BUNSHIN_FIDELITY_OUT="$RESULTS_DIR/fidelity.json" \
     "$PY" -m pytest -p no:cacheprovider -q -rfE --durations=5 \
       --junitxml="$RESULTS_DIR/junit-fork.xml" "${fork_tests[@]}") || rc=1
  # and once more cloning by injection, REPARENT only: the path of a module without FORK
  (cd "$REPO" && BUNSHIN_KMOD=1 BUNSHIN_KMOD_FORK=0 BUNSHIN_STATE_DIR=/run/bunshin-state \
     BUNSHIN_CACHE_DIR=/run/tmp/bunshin-cache \
     "$PY" -m pytest -p no:cacheprovider -q -rfE \
       --junitxml="$RESULTS_DIR/junit-fork-reparent.xml" tests/test_fork.py \
       tests/test_fork_stopped.py) || rc=1
fi
"$PY" bench_share_stats.py | tee "$RESULTS_DIR/bench.log" || rc=1
(cd "$REPO" && BUNSHIN_STATE_DIR=/run/bunshin-state BUNSHIN_CACHE_DIR=/run/tmp/bunshin-cache \
   "$PY" "$TESTS/bench_guest.py") | tee -a "$RESULTS_DIR/bench.log" || rc=1
exit $rc
