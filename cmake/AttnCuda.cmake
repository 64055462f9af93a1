# The CUDA backend is built when nvcc is found (ATTN_ENABLE_CUDA=OFF skips it). GPU code is
# generated for real architectures only; the CUDA runtime is linked statically so a server binary
# needs nothing but the driver on the GPU node.
option(ATTN_ENABLE_CUDA "Build the CUDA backend when a CUDA compiler is found" ON)
set(ATTN_HAVE_CUDA OFF)
if(ATTN_ENABLE_CUDA)
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Portable kernels for A100 (sm_80), H100/H200 (sm_90a: also admits the Hopper-only
      # instructions) and B200 (sm_100).
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90a-real;100-real")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 knows no CUDA20 flag for nvcc
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    find_package(CUDAToolkit REQUIRED)
    set(ATTN_HAVE_CUDA ON)
  endif()
endif()
message(STATUS "attnserve: CUDA backend ${ATTN_HAVE_CUDA} (archs: ${CMAKE_CUDA_ARCHITECTURES})")
