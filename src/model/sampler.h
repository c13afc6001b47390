// Text generation from a Transformer within a fixed context window T (the trained context).
//
// Window semantics: the model reads the tokens since the window's start, at RoPE positions
// 0, 1, ... from that start, never more than T of them. When the next token would make the
// window longer than T, the window restarts with the last T/2 tokens (rounded up), so each
// prediction sees between T/2 and T tokens of context. A prompt longer than T starts the window
// the same way. With the KV cache, each restart recomputes the cache once (a forward over T/2
// tokens) and every other token costs one decode step over at most T keys: generation is linear
// in its length. Without the cache the same windows are recomputed in full for every token (the
// reference the cached path must match).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/transformer.h"

namespace moetrain {

class WindowDecoder {
 public:
  // context: T, in [1, model.max_seq_len]; kv_cache false recomputes the window every token.
  WindowDecoder(Transformer& model, const float* params, int64_t context, bool kv_cache = true);

  // Logits (V) for the token after the prompt (non-empty); restarts the sequence.
  const float* start(const std::vector<int32_t>& prompt);
  // Appends token; logits (V) for the one after it. Valid until the next call.
  const float* push(int32_t token);

  int64_t context() const { return T_; }
  int64_t vocab_size() const { return model_.config().vocab_size; }
  int64_t window_start() const { return start_; }  // index into tokens() of RoPE position 0
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int64_t recomputes() const { return recomputes_; }  // full forwards over a window
  const KvCache& cache() const { return cache_; }

 private:
  const float* window_logits();  // full forward over the window

  Transformer& model_;
  const float* params_;
  int64_t T_;
  bool kv_cache_;
  KvCache cache_;
  std::vector<int32_t> tokens_;
  int64_t start_ = 0, recomputes_ = 0;
};

struct SampleOptions {
  int64_t context = 0;       // the window T
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 40;        // 0 = every token
  int64_t max_tokens = 200;
  uint64_t seed = 1;
  bool kv_cache = true;
  int32_t stop_token = -1;  // generation ends after drawing it (a tokenizer's end of document)
};

// The next token from logits (V): greedy at temperature 0, else among the top_k most likely,
// drawn with the counter-based RNG of (seed, draw).
int32_t choose_token(const float* logits, int64_t V, const SampleOptions& opt, uint64_t draw);

// Continues prompt by opt.max_tokens tokens, or up to and including opt.stop_token; on_token (may be empty) sees each as it is drawn.
// The decoder is left as generation ended (its counters describe the work done).
std::vector<int32_t> sample_tokens(WindowDecoder& dec, const std::vector<int32_t>& prompt,
                                   const SampleOptions& opt,
                                   const std::function<void(int32_t)>& on_token = {});

}  // namespace moetrain
