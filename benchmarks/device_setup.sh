#!/usr/bin/env bash
# Make `import portable_ops` (with its backends and conformance sub-packages) work on a bare GPU
# machine holding a copy of the checkout and no network: an editable install when setuptools can
# do it offline, else symlinks that reproduce the package-dir mapping of pyproject.toml.
# Usage, from the checkout's root: source benchmarks/device_setup.sh
pip install --no-deps --no-build-isolation -e . -q >/tmp/portable_ops_pip.log 2>&1 || true
if ! python -c "import portable_ops.backends.triton, portable_ops.conformance" 2>/dev/null; then
    ln -sfn "$PWD/backends" portable_ops/backends
    ln -sfn "$PWD/conformance" portable_ops/conformance
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts in benchmarks/ run from outside the root
    echo "device_setup: editable install failed (see /tmp/portable_ops_pip.log); using symlinks"
fi
python -c "import portable_ops.backends.triton as t, triton, torch; print('device_setup: torch', torch.__version__, 'triton', triton.__version__, t.BACKEND.description)"
