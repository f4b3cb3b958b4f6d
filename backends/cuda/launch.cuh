// Programmatic dependent launch (launch.py): a kernel's blocks may start while the previous
// kernel in the stream finishes. Every kernel calls pdl_trigger first (its successor may then
// be scheduled) and pdl_wait before it reads anything an earlier kernel wrote or writes
// anything; only loads of weights may come before the wait. Both are no-ops before sm_90 and
// for kernels launched without the attribute.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Both, for kernels with nothing to load before the wait.
__device__ __forceinline__ void pdl_start() {
    pdl_trigger();
    pdl_wait();
}
