#!/usr/bin/env bash
# check_exports.sh LIB hidden|exposed: whether LIB exports definitions of the C++ runtime itself:
# members of its non-template classes (locale, ios_base, the standard exceptions), its __throw_
# helpers, its transaction clones. Code of ours never defines those (counting every strong std::
# symbol would not do: link-time optimisation turns template instances of ours into strong
# ones). `hidden` must find none (the library went through sluice_private_static_runtimes,
# cmake/sluice_link.cmake); `exposed`, the same library linked without it, must find some, or
# the check could not tell the two apart.
set -euo pipefail
lib=$1 want=$2
rt=$(nm -D --defined-only "$lib" | c++filt |
  grep -E ' (transaction clone for std::|(typeinfo|vtable) for std::(exception|bad_|logic_error|runtime_error)|std::(locale|ios_base|exception|logic_error|runtime_error|bad_alloc)::|std::__throw_)' || true)
n=$(grep -c . <<<"$rt" || true)
if [ "$n" -gt 0 ]; then got=exposed; else got=hidden; fi
echo "$lib: $n of the C++ runtime's own definitions exported (runtime $got), expected $want"
[ "$got" = "$want" ] || { head -5 <<<"$rt"; exit 1; }
