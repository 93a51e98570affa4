#!/usr/bin/env bash
# transformers' own tests (tests/test_modeling_common.py and the files beside it) for the INSTALLED transformers
# release, from that release's source distribution on PyPI, cached in the venv: VENV/transformers-tests/VERSION/tests.
# Fetched once per version (a cached version is reused, nothing is downloaded), never vendored into this repository.
# The conformance tier (tests/conformance, docs/api.md §6a) imports them; make test's set-up runs this script.
#
# Usage: scripts/fetch_transformers_tests.sh [VENV]   (default: .venv)
set -euo pipefail

VENV="${1:-.venv}"
PYTHON="$VENV/bin/python"
if [[ ! -x "$PYTHON" ]]; then
    echo "fetch_transformers_tests.sh: no python at $PYTHON (pass the virtual environment as the first argument)" >&2
    exit 2
fi
VERSION="$("$PYTHON" -c 'import transformers; print(transformers.__version__)')"
DEST="$VENV/transformers-tests/$VERSION"
if [[ -f "$DEST/tests/test_modeling_common.py" ]]; then
    exit 0
fi

mkdir -p "$VENV/transformers-tests"
WORK="$(mktemp -d "$VENV/transformers-tests/.fetch.XXXXXX")"      # beside DEST: the final mv is a rename
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "transformers==$VERSION" -d "$WORK"
# The whole tests/ folder (5.24.0's sdist holds only its top-level files), moved into place in one step.
tar xzf "$WORK/transformers-$VERSION.tar.gz" -C "$WORK" "transformers-$VERSION/tests"
rm -rf "$DEST"
mv "$WORK/transformers-$VERSION" "$DEST"
echo "transformers $VERSION tests cached in $DEST/tests"
