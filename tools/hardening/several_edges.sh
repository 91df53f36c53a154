#!/usr/bin/env bash
# Issue 31, several edges: what killing one of two edges costs.
#
# Runs tests/faults/test_several_edges.py's kill case (its own stack: control-plane, two
# edges, two nodes and a worker given the first edge only) against the sources of
# CHECKOUT (default: this checkout), and prints its figures: requests through the second
# edge while the first is SIGKILLed (3 streams in flight, 5 requests after), and how the
# streams the killed edge carried ended. Code without several edges never links a node
# to the second edge: its requests fail and the test's asserts then fail too; the
# figures print either way.
#
#   tools/hardening/several_edges.sh                   # this checkout
#   tools/hardening/several_edges.sh /tmp/base-295b9aa  # a `git worktree add` of main
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
    tests/faults/test_several_edges.py -k killing -s --timeout 600 2>&1 |
    grep -E '^\[test_|passed|failed' | cut -c1-420 || true
