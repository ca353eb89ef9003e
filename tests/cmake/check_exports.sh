#!/usr/bin/env bash
# check_exports.sh LIB hidden|exposed: whether LIB exports the C++ runtime's own definitions
# (std::locale::classic(), which only libstdc++ defines). `hidden` must not find them (the
# library went through sluice_private_static_runtimes, cmake/sluice_link.cmake); `exposed`, the
# same library linked without it, must, or the check could not tell the two apart.
set -euo pipefail
lib=$1 want=$2
syms=$(nm -D --defined-only "$lib" | c++filt)
if grep -q 'std::locale::classic()' <<<"$syms"; then got=exposed; else got=hidden; fi
n=$(grep -c ' std::' <<<"$syms" || true)
echo "$lib: C++ runtime definitions $got ($n std:: symbols exported), expected $want"
[ "$got" = "$want" ]
