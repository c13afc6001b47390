// `moetrain sample`: continue a prompt with a trained model.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "app/checks.h"
#include "app/commands.h"
#include "core/check.h"
#include "core/rng.h"
#include "core/threads.h"
#include "data/tokenizer.h"
#include "train/trainer.h"

namespace moetrain::app {

Run add_sample_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("sample", "Generate text from a checkpoint");
  struct Args {
    std::string checkpoint, prompt = "\n";
    double temperature = 0.8;
    int64_t top_k = 40, max_tokens = 200;
    uint64_t seed = 1;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--checkpoint", args->checkpoint, "Checkpoint directory or run directory")
      ->required();
  cmd->add_option("--prompt", args->prompt, "Text to continue");
  cmd->add_option("--temperature", args->temperature, "Softmax temperature (0 = greedy)")
      ->check(number_at_least(0));
  cmd->add_option("--top-k", args->top_k, "Sample among the k most likely tokens (0 = all)")
      ->check(integer_in(0));
  cmd->add_option("--max-tokens", args->max_tokens, "Tokens to generate")
      ->check(integer_in(0));
  cmd->add_option("--seed", args->seed, "Random seed")->check(unsigned_integer());
  return [args] {
    init_threads();
    LoadedModel m = load_model(args->checkpoint);
    const ModelConfig& cfg = m.config.model;
    MOETRAIN_CHECK(cfg.vocab_size >= kByteVocab,
                   "sample: the model's vocabulary ({}) is not the byte tokenizer's",
                   cfg.vocab_size);
    std::vector<int32_t> tokens;
    for (uint16_t t : byte_encode(args->prompt)) tokens.push_back(t);
    MOETRAIN_CHECK(!tokens.empty(), "sample: --prompt must not be empty");
    const int64_t V = cfg.vocab_size;
    Rng rng(args->seed, rng_stream(RngPurpose::Sample, 0, 0));
    std::vector<int32_t> generated;
    std::vector<std::pair<float, int32_t>> cand(static_cast<std::size_t>(V));
    fmt::print("{}", args->prompt);
    for (int64_t i = 0; i < args->max_tokens; ++i) {
      // The whole context (its last max_seq_len tokens) is recomputed each step: exact, and at
      // these model sizes fast enough without a KV cache.
      int64_t T = std::min<int64_t>(static_cast<int64_t>(tokens.size()), cfg.max_seq_len);
      const int32_t* ctx = tokens.data() + tokens.size() - T;
      MoeStep step;
      step.training = false;
      m.model->forward(m.params.data(), ctx, nullptr, 1, T, step);
      const float* logits = m.model->logits() + (T - 1) * V;
      int32_t next = 0;
      if (args->temperature <= 0) {
        next = static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
      } else {
        for (int64_t v = 0; v < V; ++v) cand[v] = {logits[v], static_cast<int32_t>(v)};
        int64_t k = args->top_k > 0 ? std::min(args->top_k, V) : V;
        std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [](auto& a, auto& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        double mx = cand[0].first, total = 0;
        std::vector<double> p(static_cast<std::size_t>(k));
        for (int64_t j = 0; j < k; ++j)
          total += p[j] = std::exp((cand[j].first - mx) / args->temperature);
        double u = rng.uniform(static_cast<uint64_t>(i)) * total;
        next = cand[k - 1].second;
        for (int64_t j = 0; j < k; ++j) {
          if ((u -= p[j]) < 0) {
            next = cand[j].second;
            break;
          }
        }
      }
      tokens.push_back(next);
      generated.push_back(next);
      if (next < static_cast<int32_t>(kByteVocab))
        std::fputc(static_cast<unsigned char>(next), stdout);
      std::fflush(stdout);
    }
    fmt::print("\n");
    return 0;
  };
}

}  // namespace moetrain::app
