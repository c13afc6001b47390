#include "ps/global_norm.h"

#include <cmath>

#include "core/check.h"
#include "optim/clip.h"

namespace moetrain::ps {

namespace {
// Decided rounds kept for servers that ask again (a promoted backup replays at most the clock in
// flight; a few more cover reports resent across a scheduler's takeover).
constexpr int64_t kKeepDecided = 8;
}  // namespace

ClipDecision decide_clip(const std::vector<double>& partial_sum_squares, double grad_clip) {
  ClipDecision d;
  for (double p : partial_sum_squares) d.sum_squares += p;
  d.norm = std::sqrt(d.sum_squares);
  d.scale = grad_clip > 0 ? clip_coefficient(d.norm, grad_clip) : 1.0;
  return d;
}

std::optional<ClipDecision> NormRounds::report(uint32_t generation, int64_t version,
                                               int64_t server, double sum_squares,
                                               Clock::time_point now) {
  MOETRAIN_CHECK(server >= 0 && server < servers_,
                 "a partial norm from server {}; the job has servers 0..{}", server, servers_ - 1);
  MOETRAIN_CHECK(version >= 0, "a partial norm for update {}", version);
  MOETRAIN_CHECK(std::isfinite(sum_squares) && sum_squares >= 0,
                 "server {}: partial sum of squares {} for update {}", server, sum_squares,
                 version);
  auto [it, fresh] = rounds_.try_emplace({generation, version});
  Round& r = it->second;
  if (fresh) {
    r.partials.assign(static_cast<std::size_t>(servers_), std::nullopt);
    r.first = now;
  }
  if (r.decision) return r.decision;
  r.partials[static_cast<std::size_t>(server)] = sum_squares;
  std::vector<double> all;
  for (const auto& p : r.partials) {
    if (!p) return std::nullopt;
    all.push_back(*p);
  }
  r.decision = decide_clip(all, grad_clip_);
  // Rounds well behind the one just decided will not be asked for again.
  while (!rounds_.empty() && (rounds_.begin()->first.first < generation ||
                              rounds_.begin()->first.second < version - kKeepDecided))
    rounds_.erase(rounds_.begin());
  return r.decision;
}

std::optional<std::pair<int64_t, std::vector<int64_t>>> NormRounds::overdue(
    double limit_s, Clock::time_point now) const {
  const Round* worst = nullptr;
  int64_t version = -1;
  for (const auto& [key, r] : rounds_)
    if (!r.decision && (!worst || r.first < worst->first)) worst = &r, version = key.second;
  if (!worst || std::chrono::duration<double>(now - worst->first).count() <= limit_s)
    return std::nullopt;
  std::vector<int64_t> missing;
  for (std::size_t s = 0; s < worst->partials.size(); ++s)
    if (!worst->partials[s]) missing.push_back(static_cast<int64_t>(s));
  return std::make_pair(version, missing);
}

void NormRounds::drop_before(uint32_t generation) {
  std::erase_if(rounds_, [&](const auto& kv) { return kv.first.first < generation; });
}

}  // namespace moetrain::ps
