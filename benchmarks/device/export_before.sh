#!/usr/bin/env bash
# The code of an earlier commit, for same-call before/after comparisons on the GPU host
# (benchmarks/refactor_compare.py, run.sh's refactor step): `git archive` of what the plugin and
# its operator benchmark need (sglang_ext/, kernels/, patches/, benchmarks/*.py, pyproject.toml;
# no results, docs or tests) into a git-ignored folder, which a device call carries beside .gpu.
# The folder's COMMIT file names the full hash.
# Usage (from anywhere in the checkout): bash benchmarks/device/export_before.sh [COMMIT] [DIR]
#   COMMIT: default 245ca40 (the tree before the plan + run refactor); DIR: default .before
set -euo pipefail
commit=${1:-245ca40}
dir=${2:-.before}
case $dir in
  ""|.|..|*/*) echo "DIR must be one folder name at the repository root, not '$dir'" >&2; exit 2 ;;
esac
cd "$(git rev-parse --show-toplevel)"
full=$(git rev-parse --verify --quiet "$commit^{commit}") || { echo "no commit $commit" >&2; exit 2; }
rm -rf -- "$dir"
mkdir -p -- "$dir"
git archive --format=tar "$full" sglang_ext kernels patches pyproject.toml ':(glob)benchmarks/*.py' \
  | tar -x -C "$dir"
echo "$full" > "$dir/COMMIT"
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
echo "$dir: $full, $(find "$dir" -type f | wc -l) files, $(du -sk "$dir" | cut -f1) KiB on disk," \
  "$(tar -c -C "$dir" . | wc -c | awk '{printf "%.0f", $1 / 1024}') KiB as a tar"
