// A build without the CUDA backend (CMakeLists.txt builds this file in place of src/cuda's
// others): a run asking for the device is refused, naming the setting that builds it.
#include "core/check.h"
#include "model/device_ops.h"

namespace moetrain {

std::unique_ptr<DeviceOps> make_cuda_ops(const Transformer&) {
  MOETRAIN_FAIL(
      "train.device = cuda: this build has no CUDA backend (configure with "
      "-DMOETRAIN_WITH_CUDA=ON where the CUDA toolkit is installed)");
}

}  // namespace moetrain
