// The up-front memory check: a config that cannot fit is refused within moments with both
// figures; the small configs pass; the estimate grows as the model does.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ft/ft_support.h"
#include "core/check.h"
#include "io/safetensors.h"
#include "support/temp_dir.h"
#include "train/memory_estimate.h"

namespace moetrain::testing {
namespace {

TEST(MemoryEstimate, CountsParametersOptimizerAndActivations) {
  ModelConfig m;
  const MemoryEstimate e = estimate_memory(m, 16, 128, 0);
  EXPECT_GT(e.parameters, 0);
  EXPECT_EQ(e.gradients, e.parameters);
  EXPECT_EQ(e.optimizer, 2 * e.parameters);
  EXPECT_EQ(e.low_precision, 0);
  EXPECT_GT(e.activations, 0);
  EXPECT_EQ(estimate_memory(m, 16, 128, 2).low_precision, e.parameters / 2);
  ModelConfig twice = m;
  twice.n_layers *= 2;
  EXPECT_GT(estimate_memory(twice, 16, 128, 0).total(), 1.5 * e.total() - e.parameters);
  EXPECT_GT(available_memory(), 0);
}

// Bytes per parameter by ZeRO stage over d ranks, against Megatron-LM's distributed-optimizer
// table (bf16 weights with f32 gradients: 18 bytes, 6 + 12/d with the distributed optimizer;
// f32: 16, 8 + 8/d) and DeepSpeed's stages (2: the gradients too, 3: the weights too).
TEST(MemoryEstimate, StateBytesByZeroStage) {
  const double d = 8;
  auto per_param = [&](const ParamState& s) { return state_memory(s, 1000, d).total() / 1000; };
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 0)), 18);
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 1)), 6 + 12 / d);
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 2)), 2 + 16 / d);
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 3)), 18 / d);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 0, 0)), 16);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 0, 1)), 8 + 8 / d);
  // This trainer in bf16: its f32 weights and the bf16 copy, the copy sharded only at stage 3.
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 2, 1)), 10 + 8 / d);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 2, 3)), 18 / d);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("sgd", 0, 0)), 12);
  const MemoryEstimate m = state_memory(mixed_precision_state("adamw", 1), 1000, d);
  EXPECT_DOUBLE_EQ(m.parameters, 2000);
  EXPECT_DOUBLE_EQ(m.gradients, 4000);
  EXPECT_DOUBLE_EQ(m.optimizer, 12000 / d);  // master weights and both moments
  EXPECT_THROW(state_memory(trainer_state("adamw", 0, 4), 1, 1), Error);
}

TEST(MemoryEstimate, AConfigThatCannotFitIsRefusedAtOnce) {
  TempDir tmp("memory_estimate");
  const std::string cfg = write_tiny_run(tmp.path(), 2, 0).string();
  for (const std::string& set :
       {std::string("model.n_layers=1000000"), std::string("model.dim=65536")}) {
    const auto start = std::chrono::steady_clock::now();
    ProcessResult r = run_moetrain(
        {"train", "-c", cfg, "--set", "train.run_dir=" + (tmp / "run").string(), "--set", set},
        {{"OMP_NUM_THREADS", "1"}}, 60);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.code, 0) << set << "\n" << r.output();
    EXPECT_LT(s, 2.0) << set << "\n" << r.output();
    EXPECT_NE(r.output().find("needs about"), std::string::npos) << r.output();
    EXPECT_NE(r.output().find(" available ("), std::string::npos) << r.output();
  }
  ProcessResult ok =
      run_moetrain({"train", "-c", cfg, "--set", "train.run_dir=" + (tmp / "ok").string()},
                   {{"OMP_NUM_THREADS", "1"}}, 60);
  EXPECT_EQ(ok.code, 0) << ok.output();
}

// forward, eval and sample on a Hugging Face directory whose config.json describes a model far
// beyond this machine: refused within moments naming the config's size fields, instead of
// allocating for seconds and dying of std::bad_alloc.
TEST(MemoryEstimate, LoadingAModelThatCannotFitIsRefusedNamingItsSize) {
  TempDir tmp("memory_load");
  namespace fs = std::filesystem;
  const fs::path dir = tmp / "huge";
  fs::create_directories(dir);
  const nlohmann::json config = {
      {"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
      {"hidden_act", "silu"}, {"hidden_size", 1024}, {"intermediate_size", 4096},
      {"max_position_embeddings", 128}, {"num_attention_heads", 8},
      {"num_experts_per_tok", 2}, {"num_hidden_layers", 4}, {"num_key_value_heads", 8},
      {"num_local_experts", 4194304}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
      {"tie_word_embeddings", false}, {"vocab_size", 256}};
  std::ofstream(dir / "config.json") << config.dump();
  const float one = 1;
  SafetensorsWriter w;
  w.add("model.norm.weight", SafetensorsDType::F32, {1}, &one);
  w.write(dir / "model.safetensors");
  const std::vector<std::vector<std::string>> commands = {
      {"sample", "--checkpoint", dir.string(), "--prompt", "a"},
      {"eval", "--checkpoint", dir.string()},
      {"forward", "--checkpoint", dir.string(), "--input", "a", "--out",
       (tmp / "out.safetensors").string()}};
  for (const auto& args : commands) {
    const auto start = std::chrono::steady_clock::now();
    ProcessResult r = run_moetrain(args, {{"OMP_NUM_THREADS", "1"}}, 60);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.code, 0) << args[0] << "\n" << r.output();
    EXPECT_LT(s, 5.0) << args[0] << "\n" << r.output();
    for (const char* needle : {"loading", "needs about", "config.json describes a model this large",
                               "num_local_experts = 4194304"})
      EXPECT_NE(r.output().find(needle), std::string::npos) << args[0] << ": " << r.output();
    EXPECT_EQ(r.output().find("bad_alloc"), std::string::npos) << r.output();
  }
}

}  // namespace
}  // namespace moetrain::testing
