// The Python extension module kvprune_cuda._C. Importing it registers the ops
// (torch.ops.kvprune.*); the module itself only reports how it was built.
#include <pybind11/pybind11.h>

#include "kvprune/kvprune.h"
#include "torch/checks.h"
#include "torch/emulation.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvprune_cuda native extension: registers torch.ops.kvprune and reports build info";
  m.def("build_info", [] {
    pybind11::dict info;
    info["version"] = kvprune::version();
    info["cuda"] = kvprune::cuda_compiled();
    info["cuda_archs"] = kvprune::cuda_archs();
    info["cuda_emulator"] = kvprune::emu::compiled();  // CUDA kernels runnable on the CPU
    info["torch"] = KVPRUNE_TORCH_VERSION;  // the torch it was compiled against
    info["cpu_kernels"] = kvprune::cpu_kernels();  // chosen for this CPU at run time
    return info;
  }, "Version, whether CUDA kernels (and their emulator) are compiled in, and for which "
     "architectures; the CPU kernels this machine runs.");
  // Backs kvprune_cuda.testing.emulate_cuda(); schedule: 0 forward, 1 reverse, 2 shuffled.
  m.def("_set_cuda_emulation", [](bool enabled, int schedule, uint64_t seed, int sm_count,
                                  int host_threads, bool slow_worker) {
    if (schedule < 0 || schedule > 2) throw pybind11::value_error("schedule must be 0, 1 or 2");
    kvprune::emu::Options options;
    options.schedule = static_cast<kvprune::emu::Schedule>(schedule);
    options.seed = seed;
    options.sm_count = sm_count;
    options.host_threads = host_threads;
    options.slow_worker = slow_worker;
    kvprune::torch_ext::set_cuda_emulation(enabled, options);
  });
  m.def("_cuda_emulation_enabled", &kvprune::torch_ext::cuda_emulation_enabled);
  m.def("cpu_workspace_bytes", &kvprune::torch_ext::cpu_workspace_bytes,
        "Bytes of the calling thread's cached CPU workspace (kept between CPU calls).");
  m.def("release_cpu_workspace", &kvprune::torch_ext::release_cpu_workspace,
        "Frees the calling thread's cached CPU workspace; the next CPU op allocates again.");
  m.def("_emulated_launch_counts", [] {  // kernel name -> launches so far (coverage reports)
    pybind11::dict counts;
    kvprune::emu::for_each_launch_count(
        [](void* ctx, const char* kernel, uint64_t launches) {
          (*static_cast<pybind11::dict*>(ctx))[kernel] = launches;
        },
        &counts);
    return counts;
  });
}
