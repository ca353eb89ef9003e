#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian machine (root or sudo).
# Only missing packages are installed; nothing is downloaded outside Debian and PyPI.
set -euo pipefail
want=()
command -v cmake >/dev/null || want+=(cmake)
command -v ninja >/dev/null || want+=(ninja-build)
command -v g++ >/dev/null || want+=(g++)
command -v python3 >/dev/null || want+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || want+=(python3-venv)
if [ "${1:-}" = "--tests" ]; then
  [ -f /usr/include/gtest/gtest.h ] || want+=(libgtest-dev)
  [ -f /usr/include/gmock/gmock.h ] || want+=(libgmock-dev)
  [ -f /usr/include/infiniband/verbs.h ] || want+=(libibverbs-dev)
  [ -e /etc/libibverbs.d/rxe.driver ] || want+=(rdma-core ibverbs-providers)
  # The fuzz targets (tests/fuzz): clang, and libFuzzer's runtime, which Debian ships in the
  # compiler-rt package (libclang_rt.fuzzer-x86_64.a); clang only recommends it.
  command -v clang++ >/dev/null || want+=(clang)
  # The directory backends (docs/cluster.md): their client libraries, and the real servers
  # their tests start on loopback ports.
  [ -f /usr/include/x86_64-linux-gnu/curl/curl.h ] || [ -f /usr/include/curl/curl.h ] || want+=(libcurl4-openssl-dev)
  [ -f /usr/include/hiredis/hiredis.h ] || want+=(libhiredis-dev)
  command -v etcd >/dev/null || want+=(etcd-server)
  command -v etcdctl >/dev/null || want+=(etcd-client)
  command -v redis-server >/dev/null || want+=(redis-server)
  ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-*.a >/dev/null 2>&1 ||
    want+=("libclang-rt-$(clang++ --version 2>/dev/null | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1 | grep . || echo 14)-dev")
fi
[ ${#want[@]} -eq 0 ] && exit 0
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
echo "install-deps: installing ${want[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends "${want[@]}" >/dev/null 2>&1 || {
  $SUDO apt-get update >/dev/null && $SUDO apt-get install -y --no-install-recommends "${want[@]}" >/dev/null; }
