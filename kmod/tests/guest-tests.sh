#!/bin/bash
# Runs inside the QEMU guest (chroot of the host root) once bunshin.ko is
# loaded: the pytest suite, then the benchmark; exit 0 only if both pass.
set -u -o pipefail
cd "$(dirname "$0")"
PY=${BUNSHIN_GUEST_PYTHON:?}
args=()
[ -s "$RESULTS_DIR/pytest.args" ] && mapfile -d '' args < "$RESULTS_DIR/pytest.args"
rc=0
"$PY" -m pytest -p no:cacheprovider -q -rfE --durations=5 --junitxml="$RESULTS_DIR/junit.xml" \
    test_kmod.py "${args[@]}" || rc=1
"$PY" bench_share_stats.py | tee "$RESULTS_DIR/bench.log" || rc=1
exit $rc
