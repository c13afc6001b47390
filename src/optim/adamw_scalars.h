// The per-step scalars of AdamW (optim/adamw.h), shared by the CPU update and the device kernel
// (cuda/kernels.h adamw_step) so that both compute them once, the same way: in double from the
// config, the float lr and the 1-based step t, each rounded to float once.
#pragma once
#include <cmath>
#include <cstdint>

namespace moetrain {

struct AdamWScalars {
  float beta1 = 0.9f, one_minus_beta1 = 0.1f, beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float decay = 1.0f;       // 1 − lr·wd
  float step_size = 0.0f;   // lr / (1 − β1^t)
  float bias2_sqrt = 1.0f;  // √(1 − β2^t)
};

inline AdamWScalars adamw_scalars(double beta1, double beta2, double eps, double weight_decay,
                                  float lr, int64_t step) {
  const double t = static_cast<double>(step);
  AdamWScalars s;
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.decay = static_cast<float>(1.0 - double(lr) * weight_decay);
  s.step_size = static_cast<float>(double(lr) / (1.0 - std::pow(beta1, t)));
  s.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
  return s;
}

}  // namespace moetrain
