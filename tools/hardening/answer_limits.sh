#!/usr/bin/env bash
# Issue 29, item 1: what one oversized answer does to the other runs of its node.
#
# Runs tests/faults/test_large_answers.py (its own stack: control-plane, edge, two nodes,
# a worker, a real llama.cpp and a loopback engine that answers 20 MiB) against the
# sources of CHECKOUT (default: this checkout), and prints each case's figures: the
# attacking request's answer, how the node's other runs ended during and after it, and
# how many times the node registered again (a dropped link). The test's own asserts
# fail on code without the fix; the figures print either way.
#
#   tools/hardening/answer_limits.sh                 # this checkout
#   tools/hardening/answer_limits.sh /tmp/base-2e55167  # a `git worktree add` of main
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
checkout="$(cd "${1:-$here}" && pwd)"
paths=()
for src in proto/src services/edge/src services/node/src services/control-plane/src services/worker/src; do
    paths+=("$checkout/$src")
done
cd "$here"
echo "sources: $checkout ($(git -C "$checkout" rev-parse --short HEAD))"
PYTHONPATH="$(IFS=:; echo "${paths[*]}")" .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/faults/test_large_answers.py -s --timeout 600 2>&1 |
    grep -E '^\[test_|passed|failed' | cut -c1-420 || true
