#!/usr/bin/env bash
# docs/configuration.md's parameter table against `sluice-bench --list-params` of this build:
# every row the build prints is in the doc exactly once, and the doc repeats no row. (The doc
# is generated from a build with rdma and CUDA, so it may hold rows this build lacks.)
# usage: params_table.sh SLUICE_BENCH DOC
set -euo pipefail
bench=$1 doc=$2
rows=$("$bench" --list-params | grep '^| `')
fail=0
while IFS= read -r row; do
  n=$(grep -cxF -- "$row" "$doc" || true)
  if [ "$n" != 1 ]; then
    echo "docs/configuration.md has this row $n time(s), want 1 (regenerate with sluice-bench --list-params):" >&2
    echo "  $row" >&2
    fail=1
  fi
done <<<"$rows"
dups=$(grep '^| `' "$doc" | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "docs/configuration.md repeats these rows:" >&2
  echo "$dups" >&2
  fail=1
fi
[ "$fail" = 0 ] && echo "parameter table: $(wc -l <<<"$rows") rows match"
exit "$fail"
