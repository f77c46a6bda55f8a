# Sourced by the GPU-machine scripts before they build omni_kernels._C: CUDA_HOME (when unset,
# the first of CUDA 13.0 and /usr/local/cuda that has nvcc) and OMNI_CUDA_ARCHS (default 90a,
# an H100/H200's sm_90a).
if [ -z "${CUDA_HOME:-}" ]; then
    for dir in /usr/local/cuda-13.0 /usr/local/cuda; do
        if [ -x "$dir/bin/nvcc" ]; then export CUDA_HOME=$dir; break; fi
    done
fi
export OMNI_CUDA_ARCHS=${OMNI_CUDA_ARCHS:-90a}
