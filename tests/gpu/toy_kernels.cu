// Tiny kernels for executor tests and launch-overhead measurements (not model kernels).
// Each kernel that waits on its predecessor through PDL calls griddepcontrol.wait first and
// lets its dependents start early with griddepcontrol.launch_dependents.
#include <stdint.h>

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// completion header: sequence and frame copied from the staging header
extern "C" __global__ void toy_begin(const int32_t* staging, int32_t* completion) {
  pdl_wait();
  if (threadIdx.x == 0 && blockIdx.x == 0) { completion[0] = staging[0]; completion[1] = staging[1]; }
  pdl_launch();
}

// y = a * x + b + w  (w: a weight vector; x from staging or scratch)
extern "C" __global__ void toy_axpb(const float* x, const float* w, float* y, float a, float b, int32_t n) {
  pdl_wait();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b + w[i];
  pdl_launch();
}

// y += t (t: a tuned buffer filled once at startup)
extern "C" __global__ void toy_add_tuned(float* y, const float* t, int32_t n) {
  pdl_wait();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += t[i];
  pdl_launch();
}

extern "C" __global__ void toy_fill(float* t, float v, int32_t n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) t[i] = v * (float)i;
}

// cache[page * n + i] = y[i]; completion[2 + i] = bits of y[i]
extern "C" __global__ void toy_finish(const float* y, float* cache, int64_t page, int32_t* completion, int32_t n) {
  pdl_wait();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { cache[page * n + i] = y[i]; completion[2 + i] = __float_as_int(y[i]); }
  pdl_launch();
}

// does nothing but the PDL handshake: node-overhead measurements
extern "C" __global__ void toy_nop(int32_t* sink, int32_t v) {
  pdl_wait();
  if (v == -12345 && threadIdx.x == 0) sink[0] = v;
  pdl_launch();
}
