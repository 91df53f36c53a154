#!/usr/bin/env bash
# Issue 31, how an HA fleet holds: tests/faults/test_edge_ha.py (two edges on one PostgreSQL
# behind tools/tcp_balancer.py, two nodes and a worker given the first edge only) against
# the sources of CHECKOUT (default: this checkout), printing its counts: an edge SIGKILLed
# under load (sent, completed, failed, lost), PostgreSQL restarted under load (the same,
# and the file uploads meanwhile by status), a response chain and a batch across an edge
# kill. On code where the nodes never link to the second edge, the tests stop at their
# start with what each edge's catalog shows; on code without the shared stores, the chain,
# the uploads and the batch fail with the other edge's 404.
#
#   tools/hardening/edge_ha.sh                   # this checkout
#   tools/hardening/edge_ha.sh /tmp/base-295b9aa  # a `git worktree add` of main
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
    tests/faults/test_edge_ha.py -s --timeout 600 2>&1 |
    grep -E '^\[test_|^E +(AssertionError|assert)| in [0-9.]+s' | cut -c1-420 || true
