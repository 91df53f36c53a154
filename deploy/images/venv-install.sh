#!/bin/sh
# The one install step of every IOP image's builder stage (bind-mounted, never in an image):
#   venv-install.sh LOCK... [-- LOCAL_PACKAGE_DIR...]
# makes the venv /opt/venv, installs the LOCKs' pinned packages there with --require-hashes and
# --no-deps (a lock is the whole closure), then the local packages (./proto, ./services/<name>).
# The wheels come from /wheels (the repository's wheelhouse/, `make wheelhouse`); when it holds
# none (a plain `docker compose up --build` of a fresh clone) pip takes the same pinned, hashed
# files from the package index instead. Either way two builds of one commit install the same bytes.
set -eu

LOCKS=
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    LOCKS="$LOCKS --requirement $1"
    shift
done
[ "$#" -gt 0 ] && shift     # the --
WHEELS=/wheels
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    INDEX=--no-index          # offline: the wheelhouse only
else
    INDEX=                    # no wheelhouse: the package index, still pinned by hash
    echo "venv-install: no wheels in the wheelhouse, using the package index" >&2
fi
PIP="/opt/venv/bin/python -m pip --disable-pip-version-check --no-cache-dir install --quiet"

python3 -m venv /opt/venv
# shellcheck disable=SC2086  # INDEX is one word or none, LOCKS pairs of words
$PIP $INDEX --find-links "$WHEELS" --only-binary=:all: --require-hashes --no-deps $LOCKS
if [ "$#" -gt 0 ]; then
    # setuptools (in the lock) builds them here: no build isolation, so no index needed.
    $PIP --no-index --no-deps --no-build-isolation "$@"
fi
