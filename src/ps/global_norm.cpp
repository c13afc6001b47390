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

const char* round_kind_name(RoundKind k) {
  return k == RoundKind::Reweight ? "reweight" : k == RoundKind::Clip ? "clip" : "experts";
}

RoundKind parse_round_kind(const std::string& s) {
  if (s == "reweight") return RoundKind::Reweight;
  if (s == "experts") return RoundKind::Experts;
  MOETRAIN_CHECK(s == "clip", "a server round of kind '{}' (expected experts, reweight or clip)",
                 s);
  return RoundKind::Clip;
}

ClipDecision decide_clip(double sum_squares, double grad_clip) {
  ClipDecision d;
  d.sum_squares = sum_squares;
  d.norm = std::sqrt(sum_squares);
  d.scale = grad_clip > 0 ? clip_coefficient(d.norm, grad_clip) : 1.0;
  return d;
}

std::optional<std::vector<double>> NormRounds::report(uint32_t generation, int64_t version,
                                                      RoundKind kind, int64_t server,
                                                      std::vector<double> part,
                                                      Clock::time_point now) {
  MOETRAIN_CHECK(server >= 0 && server < servers_,
                 "a {} report from server {}; the job has servers 0..{}", round_kind_name(kind),
                 server, servers_ - 1);
  MOETRAIN_CHECK(version >= 0, "a {} report for update {}", round_kind_name(kind), version);
  for (double v : part)
    MOETRAIN_CHECK(std::isfinite(v) && v >= 0, "server {}: a {} figure of {} for update {}",
                   server, round_kind_name(kind), v, version);
  auto [it, fresh] = rounds_.try_emplace({generation, version, static_cast<int>(kind)});
  Round& r = it->second;
  if (fresh) {
    r.parts.assign(static_cast<std::size_t>(servers_), std::nullopt);
    r.first = now;
  }
  if (r.sum) return r.sum;
  for (const auto& p : r.parts)
    MOETRAIN_CHECK(!p || p->size() == part.size(),
                   "server {}: {} {} figures for update {}, another server sent {}", server,
                   part.size(), round_kind_name(kind), version, p->size());
  r.parts[static_cast<std::size_t>(server)] = std::move(part);
  std::vector<double> sum;
  for (const auto& p : r.parts) {
    if (!p) return std::nullopt;
    if (sum.empty()) {
      sum = *p;
    } else {
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += (*p)[i];
    }
  }
  r.sum = std::move(sum);
  // Rounds well behind the one just decided will not be asked for again.
  while (!rounds_.empty() && (std::get<0>(rounds_.begin()->first) < generation ||
                              std::get<1>(rounds_.begin()->first) < version - kKeepDecided))
    rounds_.erase(rounds_.begin());
  return rounds_.at({generation, version, static_cast<int>(kind)}).sum;
}

std::optional<std::pair<int64_t, std::vector<int64_t>>> NormRounds::overdue(
    double limit_s, Clock::time_point now) const {
  const Round* worst = nullptr;
  int64_t version = -1;
  for (const auto& [key, r] : rounds_)
    if (!r.sum && (!worst || r.first < worst->first)) worst = &r, version = std::get<1>(key);
  if (!worst || std::chrono::duration<double>(now - worst->first).count() <= limit_s)
    return std::nullopt;
  std::vector<int64_t> missing;
  for (std::size_t s = 0; s < worst->parts.size(); ++s)
    if (!worst->parts[s]) missing.push_back(static_cast<int64_t>(s));
  return std::make_pair(version, missing);
}

void NormRounds::drop_before(uint32_t generation) {
  std::erase_if(rounds_, [&](const auto& kv) { return std::get<0>(kv.first) < generation; });
}

}  // namespace moetrain::ps
