# Sourced by the GPU-machine scripts: install the wheels carried in .whl/ (packages the
# machine lacks, e.g. diffusers) into /tmp/site without their dependencies, and put it and
# the repository on PYTHONPATH. The machine has no network: nothing else is installed.
if compgen -G '.whl/*.whl' >/dev/null; then
    echo "== installing carried wheels from .whl/ into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
