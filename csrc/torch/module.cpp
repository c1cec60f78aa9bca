// The Python extension module kvprune_cuda._C. Importing it registers the ops
// (torch.ops.kvprune.*); the module itself only reports how it was built.
#include <pybind11/pybind11.h>

#include "kvprune/kvprune.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvprune_cuda native extension: registers torch.ops.kvprune and reports build info";
  m.def("build_info", [] {
    pybind11::dict info;
    info["version"] = kvprune::version();
    info["cuda"] = kvprune::cuda_compiled();
    info["cuda_archs"] = kvprune::cuda_archs();
    info["torch"] = KVPRUNE_TORCH_VERSION;  // the torch it was compiled against
    return info;
  }, "Version, whether CUDA kernels are compiled in, and for which architectures.");
}
