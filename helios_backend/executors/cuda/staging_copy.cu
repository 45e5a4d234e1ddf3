// Staging-copy kernels of the CUDA executor: the staging copy in and the completion copy out,
// as kernel nodes that read/write mapped pinned host memory over PCIe. A kernel node costs
// about a microsecond where a memcpy node costs several (measured on the H200), and it takes
// part in programmatic dependent launch like the model's kernels.
//
// Built once with nvcc and shipped as staging_copy.fatbin, machine code for every architecture
// kernel modules are prepared for plus compute_80 PTX for newer devices (the driver picks the
// image; the executor compiles nothing):
//   nvcc -fatbin -O3 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_86,code=sm_86 \
//     -gencode=arch=compute_89,code=sm_89 -gencode=arch=compute_90a,code=sm_90a \
//     -gencode=arch=compute_100a,code=sm_100a -gencode=arch=compute_80,code=compute_80 \
//     -o staging_copy.fatbin staging_copy.cu
#include <stdint.h>

// griddepcontrol exists from sm_90 on; older devices launch without PDL, where the full
// dependency it would relax is what a plain launch gives anyway.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" :::)
#define WAIT_FOR_PREDECESSOR() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define LAUNCH_DEPENDENTS()
#define WAIT_FOR_PREDECESSOR()
#endif

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
  LAUNCH_DEPENDENTS();
  copy_runs(staging, frame, runs);
}

// device completion buffer -> host completion frame (mapped). Last node of a step.
extern "C" __global__ void helios_complete_out(uint8_t* host, const uint8_t* completion, uint32_t nbytes) {
  WAIT_FOR_PREDECESSOR();
  Runs runs = {{0, 0, 0, 0}, {nbytes, 0, 0, 0}};
  copy_runs(host, completion, runs);
  __threadfence_system();          // the host reads these words once the frame's event fires
}
