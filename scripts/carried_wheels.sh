# Sourced by the GPU-machine scripts: install the wheels carried in .whl/ (packages the
# machine lacks, e.g. diffusers) into /tmp/site without their dependencies, and put it and
# the repository on PYTHONPATH. The machine has no network: nothing else is installed.
if compgen -G '.whl/*.whl' >/dev/null; then
    echo "== installing carried wheels from .whl/ into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The serving stack (fastapi, uvicorn, pydantic, prometheus-client, httpx and their
# dependencies, for Python 3.12) lives in .whl/serve/, installed only when asked for:
# OMNI_SERVE_WHEELS=1 (the GPU serving tests, tests/serve/test_gpu_serve.py).
if [ "${OMNI_SERVE_WHEELS:-0}" = 1 ]; then
    if compgen -G '.whl/serve/*.whl' >/dev/null; then
        echo "== installing the carried serving wheels from .whl/serve/ into /tmp/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/serve/*.whl || { echo "installing .whl/serve/*.whl failed" >&2; exit 1; }
        case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
    else
        echo "OMNI_SERVE_WHEELS=1 but .whl/serve/ holds no wheels (see scripts/carried_wheels.sh)" >&2
        exit 1
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
