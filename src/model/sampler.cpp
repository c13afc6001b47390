#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/check.h"
#include "core/log.h"
#include "core/rng.h"

namespace moetrain {

WindowDecoder::WindowDecoder(Transformer& model, const float* params, int64_t context,
                             bool kv_cache)
    : model_(model), params_(params), T_(context), kv_cache_(kv_cache) {
  const ModelConfig& cfg = model.config();
  MOETRAIN_CHECK(context > 0 && context <= cfg.max_seq_len,
                 "sampling context {} must be in [1, model.max_seq_len = {}]", context,
                 cfg.max_seq_len);
  // A decode step routes its token alone. That is what the full forward computes only when each
  // token's experts depend on that token alone: token choice without capacity dropping.
  const bool per_token = cfg.n_moe_layers() == 0 ||
                         (cfg.router != RouterKind::ExpertChoice && cfg.capacity_factor <= 0.0);
  if (kv_cache_ && !per_token) {
    log_info("sampling without a KV cache: model.router = {} with model.capacity_factor = {} "
             "routes each token depending on the others in its window",
             router_kind_name(cfg.router), cfg.capacity_factor);
    kv_cache_ = false;
  }
  if (kv_cache_) cache_ = model.make_kv_cache(T_);
}

const float* WindowDecoder::window_logits() {
  const int64_t n = static_cast<int64_t>(tokens_.size()) - start_;
  ++recomputes_;
  if (kv_cache_) return model_.prefill(params_, tokens_.data() + start_, n, cache_);
  MoeStep step;
  step.training = false;
  model_.forward(params_, tokens_.data() + start_, nullptr, 1, n, step);
  return model_.logits() + (n - 1) * model_.config().vocab_size;
}

const float* WindowDecoder::start(const std::vector<int32_t>& prompt) {
  MOETRAIN_CHECK(!prompt.empty(), "sampling needs a non-empty prompt");
  tokens_ = prompt;
  const int64_t n = static_cast<int64_t>(tokens_.size());
  start_ = n > T_ ? n - (T_ + 1) / 2 : 0;
  return window_logits();
}

const float* WindowDecoder::push(int32_t token) {
  MOETRAIN_CHECK(!tokens_.empty(), "WindowDecoder::push before start");
  tokens_.push_back(token);
  const int64_t n = static_cast<int64_t>(tokens_.size());
  if (n - start_ > T_) {
    start_ = n - (T_ + 1) / 2;
    return window_logits();
  }
  if (kv_cache_) return model_.decode(params_, token, cache_);
  return window_logits();
}

int32_t choose_token(const float* logits, int64_t V, const SampleOptions& opt, uint64_t draw) {
  if (opt.temperature <= 0)
    return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  std::vector<std::pair<float, int32_t>> cand(static_cast<std::size_t>(V));
  for (int64_t v = 0; v < V; ++v) cand[v] = {logits[v], static_cast<int32_t>(v)};
  const int64_t k = opt.top_k > 0 ? std::min(opt.top_k, V) : V;
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [](auto& a, auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double mx = cand[0].first, total = 0;
  std::vector<double> p(static_cast<std::size_t>(k));
  for (int64_t j = 0; j < k; ++j) total += p[j] = std::exp((cand[j].first - mx) / opt.temperature);
  Rng rng(opt.seed, rng_stream(RngPurpose::Sample, 0, 0));
  double u = rng.uniform(draw) * total;
  for (int64_t j = 0; j < k; ++j) {
    if ((u -= p[j]) < 0) return cand[j].second;
  }
  return cand[k - 1].second;
}

std::vector<int32_t> sample_tokens(WindowDecoder& dec, const std::vector<int32_t>& prompt,
                                   const SampleOptions& opt,
                                   const std::function<void(int32_t)>& on_token) {
  std::vector<int32_t> out;
  const float* logits = dec.start(prompt);
  for (int64_t i = 0; i < opt.max_tokens; ++i) {
    const int32_t next = choose_token(logits, dec.vocab_size(), opt, static_cast<uint64_t>(i));
    out.push_back(next);
    if (on_token) on_token(next);
    if (next == opt.stop_token) break;
    if (i + 1 < opt.max_tokens) logits = dec.push(next);
  }
  return out;
}

}  // namespace moetrain
