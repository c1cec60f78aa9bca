# Decides whether CUDA kernels are compiled and for which architectures.
#
# CUDA is enabled when nvcc is found (a GPU is never required) unless
# KVPRUNE_ENABLE_CUDA=OFF. The architecture list comes from the environment
# variable KVPRUNE_CUDA_ARCHS (CMake syntax, e.g. "80;90a"), default "80;90a;100;120":
# Ampere (and, by its PTX, any later GPU), Hopper, Blackwell data-centre (sm_100, with PTX for
# sm_103) and Blackwell consumer / workstation (sm_120). No kernel uses an arch-specific
# instruction, so the Blackwell images are plain sm_100 / sm_120.
# Sets KVPRUNE_WITH_CUDA and KVPRUNE_CUDA_ARCHS_STRING.

set(KVPRUNE_WITH_CUDA OFF)
set(KVPRUNE_CUDA_ARCHS_STRING "")
if(NOT KVPRUNE_ENABLE_CUDA)
  message(STATUS "kvprune: CUDA disabled (KVPRUNE_ENABLE_CUDA=OFF); building the CPU backend only")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "kvprune: nvcc not found; building the CPU backend only")
  return()
endif()

if(DEFINED ENV{KVPRUNE_CUDA_ARCHS} AND NOT "$ENV{KVPRUNE_CUDA_ARCHS}" STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES "$ENV{KVPRUNE_CUDA_ARCHS}")
elseif(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "80;90a;100;120")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(KVPRUNE_WITH_CUDA ON)
string(REPLACE ";" "," KVPRUNE_CUDA_ARCHS_STRING "${CMAKE_CUDA_ARCHITECTURES}")
message(STATUS "kvprune: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
