// The train-step benchmarks' model presets (bench_train_step, bench_cuda_step), one table.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace moetrain::bench {

struct Preset {
  const char* name;
  int64_t C, L, NH, NKV, F, E, K, B, T;
};
// tiny: configs/tiny.toml; large: C=512, 8 layers, E=8, k=2, T=256; xl: a model a GPU is for.
inline constexpr Preset kPresets[] = {{"tiny", 128, 4, 4, 2, 256, 8, 2, 16, 128},
                                      {"large", 512, 8, 8, 8, 1024, 8, 2, 8, 256},
                                      {"xl", 1024, 8, 16, 8, 2816, 8, 2, 16, 512}};

inline ModelConfig model_of(const Preset& p) {
  ModelConfig c;
  c.dim = p.C, c.n_layers = p.L, c.n_heads = p.NH, c.n_kv_heads = p.NKV;
  c.expert_hidden = p.F, c.n_experts = p.E, c.top_k = p.K, c.max_seq_len = p.T;
  return c;
}

}  // namespace moetrain::bench
