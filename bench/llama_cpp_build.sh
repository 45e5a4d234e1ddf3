#!/usr/bin/env bash
# On the device: build llama.cpp (CUDA, sm_90) from a trimmed source tarball into WORKDIR:
# llama-server, llama-bench and llama-batched-bench in WORKDIR/build/bin. ~6 min with 16 jobs.
#   bench/llama_cpp_build.sh TARBALL WORKDIR
# (bench/gpu_llama_peer.py calls it; the tarball comes from `gpu_llama_peer.py carry`.) Before
# running a binary: export LD_LIBRARY_PATH="$(cat WORKDIR/ldx):$LD_LIBRARY_PATH" when WORKDIR/ldx
# exists (cuBLAS from the pip `nvidia` packages where /usr/local/cuda lacks it).
set -u; T0=$(date +%s)
TARBALL=$(realpath "${1:?usage: llama_cpp_build.sh TARBALL WORKDIR}"); W=$(realpath -m "${2:?usage: llama_cpp_build.sh TARBALL WORKDIR}")
mkdir -p "$W" && rm -rf "$W/llama.cpp" && tar xJf "$TARBALL" -C "$W" || exit 1
export PATH=/usr/local/cuda/bin:$PATH
SP=$(python3 -c "import site; print(site.getsitepackages()[0])"); CUX=""; rm -f "$W/ldx"
if ! ls /usr/local/cuda/include/cublas_v2.h /usr/local/cuda/targets/x86_64-linux/include/cublas_v2.h >/dev/null 2>&1; then
  H=$(find "$SP/nvidia" -name cublas_v2.h 2>/dev/null | head -1); B=$(find "$SP/nvidia" -name 'libcublas.so.*' 2>/dev/null | head -1)
  LT=$(find "$SP/nvidia" -name 'libcublasLt.so.*' 2>/dev/null | head -1)
  [ -n "$H" ] && CUX="-DCUDA_cublas_LIBRARY=$B -DCUDA_cublasLt_LIBRARY=$LT -DCMAKE_CUDA_FLAGS=-I$(dirname "$H")" && dirname "$B" > "$W/ldx"
fi
if ! ls /usr/local/cuda/lib64/libcuda.so /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/cuda/targets/x86_64-linux/lib/stubs/libcuda.so >/dev/null 2>&1; then
  D=$(ls /usr/lib/x86_64-linux-gnu/libcuda.so /usr/local/nvidia/lib64/libcuda.so /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1 2>/dev/null | head -1)
  [ -n "$D" ] && CUX="$CUX -DCUDA_cuda_driver_LIBRARY=$D" || CUX="$CUX -DGGML_CUDA_NO_VMM=ON"
fi
[ -f "$W/ldx" ] && export LD_LIBRARY_PATH=$(cat "$W/ldx"):${LD_LIBRARY_PATH:-}
# LLAMA_BUILD_TOOLS (on by default) holds llama-bench and llama-batched-bench; examples and tests stay off
cmake -B "$W/build" -S "$W/llama.cpp" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_HTML=OFF -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMIT=0c1e5709 -DLLAMA_BUILD_NUMBER=0 \
  $CUX > "$W/cfg.log" 2>&1 || { tail -20 "$W/cfg.log"; exit 1; }
cmake --build "$W/build" -j"$(nproc)" --target llama-server llama-bench llama-batched-bench > "$W/build.log" 2>&1; rc=$?
echo "llama.cpp build (llama-server llama-bench llama-batched-bench) rc=$rc after $(( $(date +%s) - T0 )) s"
[ $rc = 0 ] || tail -20 "$W/build.log"; exit $rc
