#!/usr/bin/env bash
# The "many hosts on one machine" suite (issue 19; docs/cluster.md): Sluice engines in
# separate network namespaces joined through a bridge, each process its own host.
#
#   tests/netns/run.sh                 uses the Python suite's venv (.venv-test, made by
#                                      python/run_tests.sh with the wheel of this checkout)
#   NETNS_VENV=/path/venv tests/netns/run.sh -k flap
#   NETNS_REPORT=/tmp/netns.json ...   also writes the measured numbers as JSON
#
# Needs root and iproute2 (the tests skip, saying why, without them); scenario 3 needs
# redis-server. Extra arguments go to pytest.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${NETNS_VENV:-$ROOT/.venv-test}
PY=$VENV/bin/python
if ! "$PY" -c 'import sluice, numpy, pytest, pytest_timeout' 2>/dev/null; then
  echo "tests/netns/run.sh: $PY cannot import sluice, numpy, pytest and pytest_timeout;" \
       "run python/run_tests.sh first (it makes .venv-test) or set NETNS_VENV" >&2
  exit 1
fi

# Whatever happens to pytest (a failure, Ctrl-C, SIGKILL), no namespace outlives the run: its
# namespaces carry its pid, and once it is gone they count as stale.
cleanup() { (cd "$HERE" && PYTHONPATH="$HERE/../../tools/common" "$PY" -c 'import netns; r = netns.cleanup_stale(); r and print("netns: removed", r)') || true; }
trap cleanup EXIT

cd "$HERE"  # the installed sluice is tested, never a source tree's
"$PY" -m pytest "$HERE" -q -rs --timeout=120 --durations=5 -p no:cacheprovider --rootdir "$HERE" "$@"
