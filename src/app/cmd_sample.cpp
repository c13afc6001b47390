// `moetrain sample`: continue a prompt with a trained model.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <string_view>
#include <memory>
#include <vector>

#include "app/checks.h"
#include "app/commands.h"
#include "core/check.h"
#include "core/threads.h"
#include "data/tokenizer.h"
#include "model/sampler.h"
#include "train/trainer.h"

namespace moetrain::app {

Run add_sample_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "sample",
      "Generate text from a checkpoint. The model reads at most the context it was trained on "
      "(train.seq_len, or --context) at positions counted from the window's start; when the "
      "window is full it restarts with its last half, so every token sees between T/2 and T "
      "tokens. A KV cache makes each token one decode step (linear in the length); models whose "
      "routing depends on other tokens (expert_choice, capacity_factor > 0) recompute the window "
      "per token instead.");
  struct Args {
    std::string checkpoint, prompt = "\n";
    double temperature = 0.8;
    int64_t top_k = 40, max_tokens = 200, context = 0;
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
  cmd->add_option("--context", args->context,
                  "Window T in tokens (0 = the trained context, train.seq_len of the checkpoint)")
      ->check(integer_in(0));
  cmd->add_option("--seed", args->seed, "Random seed")->check(unsigned_integer());
  return [args] {
    init_threads();
    LoadedModel m = load_model(args->checkpoint);
    const ModelConfig& cfg = m.config.model;
    const Tokenizer& tok = m.tokenizer;
    MOETRAIN_CHECK(!args->prompt.empty(), "sample: --prompt must not be empty");
    const std::vector<int32_t> prompt = tok.encode_prompt(args->prompt);
    MOETRAIN_CHECK(!prompt.empty(), "sample: --prompt '{}' encodes to no tokens", args->prompt);
    SampleOptions opt;
    opt.context = args->context > 0 ? args->context : m.trained_context;
    opt.temperature = args->temperature;
    opt.top_k = args->top_k;
    opt.max_tokens = args->max_tokens;
    opt.seed = args->seed;
    // A SentencePiece model's end of document ends the text (bytes have none: theirs is '\n').
    if (!tok.is_bytes()) opt.stop_token = tok.eod_id();
    MOETRAIN_CHECK(opt.context <= cfg.max_seq_len,
                   "sample: --context {} exceeds the model's model.max_seq_len = {}", opt.context,
                   cfg.max_seq_len);
    WindowDecoder dec(*m.model, m.params.data(), opt.context);
    fmt::print("{}", args->prompt);
    // The text grows by what decoding everything so far adds to what is out: a piece's leading
    // space, and a character split over byte pieces, come out as the whole text has them.
    std::vector<int32_t> all = prompt;
    std::size_t printed = tok.decode(prompt).size();
    sample_tokens(dec, prompt, opt, [&](int32_t t) {
      all.push_back(t);
      const std::string text = tok.decode(all);
      constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // an incomplete character
      if (!tok.is_bytes() && text.size() >= 3 && text.compare(text.size() - 3, 3, kReplacement) == 0)
        return;
      if (text.size() > printed) std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
      printed = std::max(printed, text.size());
      std::fflush(stdout);
    });
    fmt::print("\n");
    return 0;
  };
}

}  // namespace moetrain::app
