// CUDA <-> HIP portability layer for the GPU backend.
//
// Every .cu file of the GPU backend includes this header instead of <cuda_runtime.h> and is
// written once against the CUDA runtime names. Built by nvcc (SPECD_GPU=cuda) the names are
// CUDA's own; built by hipcc for AMD (SPECD_GPU=hip, __HIP_PLATFORM_AMD__ defined) they are mapped
// to the HIP runtime here. Only the subset the backend uses is mapped: add a line when a kernel
// needs a new runtime call, rather than writing #ifdefs in the kernels.
//
// Warp size caveat. NVIDIA warps are 32 lanes; AMD wavefronts are 64 lanes on CDNA (MI200/MI300)
// and 32 or 64 on RDNA (wave32 by default). The kernels never rely on the hardware warp size:
// they reduce within *logical* warps of SPECD_WARP = 32 lanes, using SPECD_SHFL_XOR with an
// explicit width of 32, which on a 64-lane wavefront shuffles within each half independently. So
// block sizes must be multiples of 32, and per-"warp" shared-memory slots are indexed by
// threadIdx.x / SPECD_WARP. Do not use the __activemask()/__ballot_sync masks (32-bit on CUDA,
// 64-bit on HIP) or warp-synchronous code without a shuffle; use __syncthreads() between phases.
//
// Shuffle caveat. CUDA's __shfl_xor_sync needs a participation mask and every named lane must
// execute it; HIP's __shfl_xor (pre-ROCm 6.2) takes no mask and newer HIP's *_sync variants take a
// 64-bit mask. SPECD_SHFL_XOR hides that; call it only where all 32 lanes of the logical warp are
// converged (the kernels call it outside any lane-dependent branch).
#pragma once

#include <cstdint>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define SPECD_HIP 1
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

// Errors.
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorNoDevice hipErrorNoDevice
#define cudaErrorInsufficientDriver hipErrorInsufficientDriver
#define cudaGetErrorString hipGetErrorString
#define cudaGetErrorName hipGetErrorName
#define cudaGetLastError hipGetLastError

// Devices.
#define cudaDeviceProp hipDeviceProp_t
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaDevAttrMemoryPoolsSupported hipDeviceAttributeMemoryPoolsSupported
#define cudaDeviceSynchronize hipDeviceSynchronize
// HIP takes the kernel as a const void* where CUDA's runtime API has a template over the kernel's type (a function,
// not a macro: a kernel template's argument list holds commas).
template <class Kernel>
inline hipError_t cudaFuncSetAttribute(Kernel kernel, hipFuncAttribute attr, int value) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize

// Memory.
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMallocAsync hipMallocAsync
#define cudaFreeAsync hipFreeAsync
#define cudaMemPool_t hipMemPool_t
#define cudaDeviceGetDefaultMemPool hipDeviceGetDefaultMemPool
#define cudaMemPoolSetAttribute hipMemPoolSetAttribute
#define cudaMemPoolAttrReleaseThreshold hipMemPoolAttrReleaseThreshold
#define cudaMemPoolTrimTo hipMemPoolTrimTo
#define cudaMemPoolGetAttribute hipMemPoolGetAttribute
#define cudaMemPoolAttrReservedMemCurrent hipMemPoolAttrReservedMemCurrent
#define cudaMemPoolAttrUsedMemCurrent hipMemPoolAttrUsedMemCurrent
#define cudaMemPoolAttrUsedMemHigh hipMemPoolAttrUsedMemHigh
#define cudaErrorMemoryAllocation hipErrorOutOfMemory
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpy2DAsync hipMemcpy2DAsync
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaMemGetInfo hipMemGetInfo

// Streams and events.
#define cudaStream_t hipStream_t
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamDestroy hipStreamDestroy
#define cudaEvent_t hipEvent_t
#define cudaEventCreate hipEventCreate
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaEventDestroy hipEventDestroy
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaMallocHost(ptr, bytes) hipHostMalloc((ptr), (bytes), hipHostMallocDefault)
#define cudaGraph_t hipGraph_t
#define cudaGraphExec_t hipGraphExec_t
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaStreamCaptureModeRelaxed hipStreamCaptureModeRelaxed
#define cudaGraphInstantiateWithFlags hipGraphInstantiateWithFlags
#define cudaGraphLaunch hipGraphLaunch
#define cudaGraphExecDestroy hipGraphExecDestroy
#define cudaGraphDestroy hipGraphDestroy
#define cudaIpcMemHandle_t hipIpcMemHandle_t
#define cudaIpcEventHandle_t hipIpcEventHandle_t
#define cudaIpcGetMemHandle hipIpcGetMemHandle
#define cudaIpcOpenMemHandle hipIpcOpenMemHandle
#define cudaIpcCloseMemHandle hipIpcCloseMemHandle
#define cudaIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define cudaIpcGetEventHandle hipIpcGetEventHandle
#define cudaIpcOpenEventHandle hipIpcOpenEventHandle
#define cudaDeviceGetPCIBusId hipDeviceGetPCIBusId
#define cudaEventInterprocess hipEventInterprocess

// Logical-warp shuffle (width 32 on any wavefront size; see the caveat above).
#define SPECD_SHFL_XOR(v, lane_mask) __shfl_xor((v), (lane_mask), 32)
#define SPECD_SHFL_UP(v, delta) __shfl_up((v), (delta), 32)
#define SPECD_BACKEND_NAME "hip"

#else  // CUDA
#define SPECD_HIP 0
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define SPECD_SHFL_XOR(v, lane_mask) __shfl_xor_sync(0xffffffffu, (v), (lane_mask), 32)
#define SPECD_SHFL_UP(v, delta) __shfl_up_sync(0xffffffffu, (v), (delta), 32)
#define SPECD_BACKEND_NAME "cuda"
#endif

// Vendor BLAS (cuBLAS / hipBLAS), for the files that define SPECD_GPU_BLAS before including this
// header (only the dequantize + GEMM path of matmul: other files need not see the BLAS headers).
// hipBLAS is used through its v2 API (HIPBLAS_V2: hipDataType and hipblasComputeType_t, ROCm >= 6),
// whose GemmEx has cuBLAS's argument list.
#if defined(SPECD_GPU_BLAS)
#if SPECD_HIP
#ifndef HIPBLAS_V2
#define HIPBLAS_V2
#endif
#include <hipblas/hipblas.h>
#define cublasHandle_t hipblasHandle_t
#define cublasStatus_t hipblasStatus_t
#define CUBLAS_STATUS_SUCCESS HIPBLAS_STATUS_SUCCESS
#define cublasCreate hipblasCreate
#define cublasSetStream hipblasSetStream
#define cublasGemmEx hipblasGemmEx
#define cublasGetStatusString hipblasStatusToString
#define CUBLAS_OP_N HIPBLAS_OP_N
#define CUBLAS_OP_T HIPBLAS_OP_T
#define CUBLAS_COMPUTE_32F HIPBLAS_COMPUTE_32F
#define CUBLAS_GEMM_DEFAULT HIPBLAS_GEMM_DEFAULT
#define CUDA_R_16BF HIP_R_16BF
#define CUDA_R_32F HIP_R_32F
#define SPECD_BLAS_NAME "hipblas"
#else
#include <cublas_v2.h>
#define SPECD_BLAS_NAME "cublas"
#endif
#endif  // SPECD_GPU_BLAS

// Lanes of a logical warp (see the warp size caveat above).
#define SPECD_WARP 32

// IEEE binary16 bits -> float, exact (subnormals included), on either backend.
__device__ __forceinline__ float specd_fp16_bits_to_float(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}
