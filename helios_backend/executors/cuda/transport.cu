// Transport kernels of the CUDA executor: the staging copy in and the completion copy out,
// as kernel nodes that read/write mapped pinned host memory over PCIe. A kernel node costs
// about a microsecond where a memcpy node costs several (measured on the H200), and it takes
// part in programmatic dependent launch like the model's kernels.
//
// Built once with nvcc and shipped as transport.cubin (the executor compiles nothing):
//   nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -o transport.cubin transport.cu
#include <stdint.h>

#define MAX_RUNS 4

struct Runs {                      // byte ranges of the frame to copy, each 16-byte aligned
  uint32_t offset[MAX_RUNS];
  uint32_t nbytes[MAX_RUNS];       // multiple of 16; 0 = unused run
};

__device__ __forceinline__ void copy_runs(uint8_t* dst, const uint8_t* src, const Runs& runs) {
  const uint32_t stride = gridDim.x * blockDim.x;
  const uint32_t start = blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
  for (int r = 0; r < MAX_RUNS; ++r) {
    const uint4* s = reinterpret_cast<const uint4*>(src + runs.offset[r]);
    uint4* d = reinterpret_cast<uint4*>(dst + runs.offset[r]);
    const uint32_t n = runs.nbytes[r] / 16;
    for (uint32_t i = start; i < n; i += stride) d[i] = s[i];
  }
}

// host frame (mapped) -> device staging buffer. First node of a step: nothing to wait for,
// so dependents may launch at once; they wait (griddepcontrol.wait) for this grid to finish.
extern "C" __global__ void helios_stage_in(uint8_t* staging, const uint8_t* frame, Runs runs) {
  asm volatile("griddepcontrol.launch_dependents;" :::);
  copy_runs(staging, frame, runs);
}

// device completion buffer -> host completion frame (mapped). Last node of a step.
extern "C" __global__ void helios_complete_out(uint8_t* host, const uint8_t* completion, uint32_t nbytes) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  Runs runs = {{0, 0, 0, 0}, {nbytes, 0, 0, 0}};
  copy_runs(host, completion, runs);
  __threadfence_system();          // the host reads these words once the frame's event fires
}
