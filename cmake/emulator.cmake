# Decides whether the SIMT emulator is built: the CUDA kernels compiled a second
# time by the host compiler (csrc/cuda/simt.cuh, csrc/emu/). It needs CUDA's headers
# (for __half, __nv_bfloat16 and the vector types), not nvcc and not a GPU.
# KVPRUNE_ENABLE_EMULATOR=OFF leaves it out. Sets KVPRUNE_WITH_EMULATOR and
# KVPRUNE_CUDA_INCLUDE_DIR.
option(KVPRUNE_ENABLE_EMULATOR "Build the SIMT emulator of the CUDA kernels" ON)
set(KVPRUNE_WITH_EMULATOR OFF)
if(NOT KVPRUNE_ENABLE_EMULATOR)
  message(STATUS "kvprune: emulator disabled (KVPRUNE_ENABLE_EMULATOR=OFF)")
  return()
endif()
if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux")
  message(STATUS "kvprune: the emulator needs Linux (fiber stacks); not built")
  return()
endif()
find_package(CUDAToolkit QUIET)
find_path(KVPRUNE_CUDA_INCLUDE_DIR cuda_fp16.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{CUDA_HOME}/include $ENV{CUDA_PATH}/include
        /usr/local/cuda/include)
if(NOT KVPRUNE_CUDA_INCLUDE_DIR)
  message(STATUS "kvprune: CUDA headers not found; the emulator is not built")
  return()
endif()
set(KVPRUNE_WITH_EMULATOR ON)
message(STATUS "kvprune: SIMT emulator on (CUDA headers in ${KVPRUNE_CUDA_INCLUDE_DIR})")
