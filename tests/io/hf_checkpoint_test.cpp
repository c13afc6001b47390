// Hugging Face model directories by hand: a MixtralConfig mapped to our model (and every field we
// cannot compute refused by name), and the tensor reader's checks on single and sharded files.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "io/file.h"
#include "io/hf_checkpoint.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// What transformers 4.40's MixtralConfig.save_pretrained writes for a small model.
json tiny_mixtral() {
  return json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.1, "intermediate_size": 96, "max_position_embeddings": 128,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": false,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0, "sliding_window": null, "tie_word_embeddings": false,
    "torch_dtype": "float32", "transformers_version": "4.40.2", "use_cache": true,
    "vocab_size": 256})");
}

ModelConfig map(const json& j) {
  return ModelConfig::from_hf_json(j, "dir/config.json");
}

void refused(json j, const char* key, json value, std::vector<std::string> needles) {
  if (value.is_discarded())
    j.erase(key);
  else
    j[key] = std::move(value);
  needles.insert(needles.begin(), "dir/config.json");
  expect_error([&] { map(j); }, needles);
}

}  // namespace

TEST(HfConfig, MapsEveryMixtralField) {
  const ModelConfig c = map(tiny_mixtral());
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.expert_hidden, 96);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.n_experts, 4);
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.max_seq_len, 128);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.init_std, 0.1);
  EXPECT_DOUBLE_EQ(c.aux_loss_coef, 0.02);
  EXPECT_DOUBLE_EQ(c.z_loss_coef, 0.0);  // Mixtral has none
  EXPECT_EQ(c.router, RouterKind::TopKSoftmax);
  EXPECT_TRUE(c.hf_mixtral_compatible());
}

TEST(HfConfig, RoundTripsOurOwnExport) {
  ModelConfig ours;
  ours.z_loss_coef = 0;
  const ModelConfig back = map(ours.to_hf_json());
  EXPECT_EQ(back.to_hf_json(), ours.to_hf_json());
}

TEST(HfConfig, OptionalFieldsTakeMixtralDefaults) {
  json j = tiny_mixtral();
  for (const char* k : {"num_key_value_heads", "rope_theta", "rms_norm_eps", "sliding_window",
                        "hidden_act", "tie_word_embeddings", "model_type"})
    j.erase(k);
  const ModelConfig c = map(j);
  EXPECT_EQ(c.n_kv_heads, 4);  // MixtralConfig: one KV head per query head
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
}

TEST(HfConfig, SlidingWindowAtLeastTheContextIsFullAttention) {
  json j = tiny_mixtral();
  j["sliding_window"] = 128;
  EXPECT_EQ(map(j).max_seq_len, 128);
}

TEST(HfConfig, RefusesWhatWeCannotCompute) {
  const json base = tiny_mixtral();
  refused(base, "hidden_act", "gelu", {"hidden_act", "gelu"});
  refused(base, "sliding_window", 64, {"sliding_window = 64", "128"});
  refused(base, "tie_word_embeddings", true, {"tie_word_embeddings = true"});
  refused(base, "head_dim", 32, {"head_dim = 32", "16"});
  refused(base, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}}, {"rope_scaling", "linear"});
  refused(base, "model_type", "llama", {"model_type", "llama"});
  refused(base, "router_jitter_noise", 0.01, {"router_jitter_noise", "0.01"});
  refused(base, "attention_dropout", 0.1, {"attention_dropout"});
  refused(base, "quantization_config", {{"quant_method", "gptq"}}, {"quantization_config"});
  refused(base, "num_attention_heads", 5, {"num_attention_heads = 5", "hidden_size = 64"});
  refused(base, "num_key_value_heads", 3, {"n_kv_heads = 3"});
  refused(base, "num_experts_per_tok", 5, {"top_k = 5"});
  refused(base, "vocab_size", int64_t{3000000000}, {"vocab_size = 3000000000", "int32"});
  refused(base, "hidden_size", "64", {"hidden_size", "must be an integer"});
  refused(base, "num_local_experts", json(json::value_t::discarded), {"num_local_experts"});
  refused(base, "intermediate_size", 0, {"intermediate_size = 0"});
}

namespace {

struct Dir {
  TempDir tmp;
  std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {7, 8};
  std::vector<float> got_a = std::vector<float>(6), got_b = std::vector<float>(2);

  Dir() { write_file_atomic(tmp.path() / "config.json", tiny_mixtral().dump()); }
  std::vector<NamedTensor> wanted() {
    return {{"a.weight", {2, 3}, got_a.data()}, {"b.weight", {2}, got_b.data()}};
  }
};

}  // namespace

TEST(HfTensors, ReadsOneFileAndWidensBf16AndF16) {
  Dir d;
  EXPECT_FALSE(is_hf_model_dir(d.tmp.path()));  // no weights yet
  std::vector<bf16> a16;
  for (float x : d.a) a16.push_back(bf16(x));
  std::vector<fp16> b16;
  for (float x : d.b) b16.push_back(fp16(x));
  SafetensorsWriter w;
  w.add("a.weight", SafetensorsDType::BF16, {2, 3}, a16.data());
  w.add("b.weight", SafetensorsDType::F16, {2}, b16.data());
  w.write(d.tmp.path() / "model.safetensors");
  ASSERT_TRUE(is_hf_model_dir(d.tmp.path()));
  read_hf_tensors(d.tmp.path(), d.wanted());
  EXPECT_EQ(d.got_a, d.a);
  EXPECT_EQ(d.got_b, d.b);
}

TEST(HfTensors, ReadsShardsThroughTheIndex) {
  Dir d;
  SafetensorsWriter w1, w2;
  w1.add("a.weight", SafetensorsDType::F32, {2, 3}, d.a.data());
  w2.add("b.weight", SafetensorsDType::F32, {2}, d.b.data());
  w1.write(d.tmp.path() / "model-00001-of-00002.safetensors");
  w2.write(d.tmp.path() / "model-00002-of-00002.safetensors");
  json index = {{"metadata", {{"total_size", 32}}},
                {"weight_map",
                 {{"a.weight", "model-00001-of-00002.safetensors"},
                  {"b.weight", "model-00002-of-00002.safetensors"}}}};
  const fs::path idx = d.tmp.path() / "model.safetensors.index.json";
  write_file_atomic(idx, index.dump());
  ASSERT_TRUE(is_hf_model_dir(d.tmp.path()));
  read_hf_tensors(d.tmp.path(), d.wanted());
  EXPECT_EQ(d.got_a, d.a);
  EXPECT_EQ(d.got_b, d.b);

  index["weight_map"]["b.weight"] = "model-00001-of-00002.safetensors";
  write_file_atomic(idx, index.dump());
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"b.weight", "model-00001-of-00002.safetensors", "does not hold it"});
  index["weight_map"]["b.weight"] = "../model-00002-of-00002.safetensors";
  write_file_atomic(idx, index.dump());
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"../model-00002-of-00002.safetensors", "not a file name"});
  index["weight_map"].erase("b.weight");
  write_file_atomic(idx, index.dump());
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"model.safetensors.index.json", "no tensor 'b.weight'"});
}

TEST(HfTensors, RefusesMissingExtraMisshapenAndOtherTypes) {
  Dir d;
  const fs::path file = d.tmp.path() / "model.safetensors";
  auto write = [&](auto&& fill) {
    SafetensorsWriter w;
    fill(w);
    w.write(file);
  };
  write([&](SafetensorsWriter& w) {
    w.add("a.weight", SafetensorsDType::F32, {2, 3}, d.a.data());
  });
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"no tensor 'b.weight'", "[2]", "model.safetensors"});
  float extra = 0;
  write([&](SafetensorsWriter& w) {
    w.add("a.weight", SafetensorsDType::F32, {2, 3}, d.a.data());
    w.add("b.weight", SafetensorsDType::F32, {2}, d.b.data());
    w.add("c.bias", SafetensorsDType::F32, {1}, &extra);
  });
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"model.safetensors", "'c.bias'", "not a parameter"});
  write([&](SafetensorsWriter& w) {
    w.add("a.weight", SafetensorsDType::F32, {3, 2}, d.a.data());
    w.add("b.weight", SafetensorsDType::F32, {2}, d.b.data());
  });
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"model.safetensors", "'a.weight'", "[3, 2]", "[2, 3]"});
  std::vector<int32_t> ints(2);
  write([&](SafetensorsWriter& w) {
    w.add("a.weight", SafetensorsDType::F32, {2, 3}, d.a.data());
    w.add("b.weight", SafetensorsDType::I32, {2}, ints.data());
  });
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); }, {"'b.weight'", "I32"});
}

TEST(HfTensors, ACheckpointWithAManifestIsNotAPlainDirectory) {
  Dir d;
  SafetensorsWriter w;
  w.add("a.weight", SafetensorsDType::F32, {2, 3}, d.a.data());
  w.write(d.tmp.path() / "model.safetensors");
  EXPECT_TRUE(is_hf_model_dir(d.tmp.path()));
  write_file_atomic(d.tmp.path() / "manifest.json", "{}");
  EXPECT_FALSE(is_hf_model_dir(d.tmp.path()));
}

// A NaN or an infinity in the weights is refused as they load, naming the tensor, instead of
// surfacing at the first step as a diverged loss.
TEST(HfTensors, RefusesNonFiniteWeightsNamingTheTensor) {
  Dir d;
  std::vector<fp16> b16 = {fp16(1.0f), fp16(65504.0f * 2)};  // the second overflows to +inf
  SafetensorsWriter w;
  w.add("a.weight", SafetensorsDType::F32, {2, 3}, d.a.data());
  w.add("b.weight", SafetensorsDType::F16, {2}, b16.data());
  w.write(d.tmp.path() / "model.safetensors");
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"model.safetensors", "tensor 'b.weight'", "1 non-finite", "element 1 is inf"});
  std::vector<float> a = d.a;
  a[4] = std::nanf("");
  SafetensorsWriter w2;
  w2.add("a.weight", SafetensorsDType::F32, {2, 3}, a.data());
  w2.add("b.weight", SafetensorsDType::F32, {2}, d.b.data());
  w2.write(d.tmp.path() / "model.safetensors");
  expect_error([&] { read_hf_tensors(d.tmp.path(), d.wanted()); },
               {"tensor 'a.weight'", "element 4 is nan"});
}
