#include "model/device_engine.h"

#include "core/check.h"

namespace moetrain {

#ifndef MOETRAIN_WITH_CUDA
std::unique_ptr<DeviceEngine> make_cuda_engine(Transformer&) {
  MOETRAIN_FAIL(
      "train.device = cuda: this build has no CUDA backend (configure with "
      "-DMOETRAIN_WITH_CUDA=ON where the CUDA toolkit is installed)");
}
#endif

}  // namespace moetrain
