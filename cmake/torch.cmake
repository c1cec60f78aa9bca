# Locates the PyTorch installation of the Python interpreter that builds the
# package (no find_package(Torch): it would drag in cuDNN and friends) and
# defines the imported target kvprune_torch_deps.
#
# Sets KVPRUNE_TORCH_HAS_CUDA when that torch is a CUDA build.
#
# The extension links the very libstdc++.so that this interpreter loads with torch
# (found in /proc/self/maps), ahead of the compiler's own C++ runtime. A toolchain
# that links libstdc++ statically (a GCC built without shared runtime libraries,
# as on the lent H200 image) would otherwise put a second copy of the C++ runtime
# into _C: c10's error messages then format numbers with facets of the other copy's
# locale and the process crashes (SIGSEGV) on the first argument error.

find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import torch, os, torch.utils.cpp_extension as ce; print(','.join(ce.include_paths())); print(os.path.join(os.path.dirname(torch.__file__), 'lib')); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or ''); print(torch.__version__); print(next((l.split()[-1] for l in open('/proc/self/maps') if '/libstdc++.so' in l), '-') if os.path.exists('/proc/self/maps') else '-')"
  OUTPUT_VARIABLE _torch_info
  RESULT_VARIABLE _torch_status
  ERROR_QUIET
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_status EQUAL 0)
  message(FATAL_ERROR "kvprune: cannot import torch with ${Python3_EXECUTABLE}; install PyTorch first")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 _torch_includes)
list(GET _torch_info 1 TORCH_LIBRARY_DIR)
list(GET _torch_info 2 _torch_cxx11_abi)
list(GET _torch_info 3 _torch_cuda_version)
list(GET _torch_info 4 TORCH_VERSION_STRING)
list(GET _torch_info 5 _torch_libstdcxx)
string(REPLACE "," ";" _torch_includes "${_torch_includes}")

set(KVPRUNE_TORCH_HAS_CUDA OFF)
if(NOT "${_torch_cuda_version}" STREQUAL "")
  set(KVPRUNE_TORCH_HAS_CUDA ON)
endif()
message(STATUS "kvprune: torch ${TORCH_VERSION_STRING} (CUDA: ${_torch_cuda_version}) at ${TORCH_LIBRARY_DIR}")

add_library(kvprune_torch_deps INTERFACE)
target_include_directories(kvprune_torch_deps SYSTEM INTERFACE ${_torch_includes})
target_compile_definitions(kvprune_torch_deps INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_cxx11_abi})
target_link_directories(kvprune_torch_deps INTERFACE "${TORCH_LIBRARY_DIR}")
target_link_libraries(kvprune_torch_deps INTERFACE c10 torch torch_cpu)
if(NOT _torch_libstdcxx STREQUAL "-")
  message(STATUS "kvprune: C++ runtime shared with torch: ${_torch_libstdcxx}")
  target_link_libraries(kvprune_torch_deps INTERFACE "${_torch_libstdcxx}")
endif()
