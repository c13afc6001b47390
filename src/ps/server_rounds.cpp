#include "ps/server_rounds.h"

#include <chrono>

#include "core/check.h"
#include "core/log.h"

namespace moetrain::ps {

namespace {

// A roll-back (a Restore, or the checkpoint query that precedes it) or a stop.
bool undoes_clock(const Incoming& in) {
  const Kind k = in.header.kind_enum();
  return k == Kind::Restore || k == Kind::Shutdown ||
         (k == Kind::CheckpointQuery && !in.json().value("write", false));
}

}  // namespace

nlohmann::json ServerRounds::agree(int64_t version, int64_t clock, uint32_t generation,
                                   RoundKind kind, const std::vector<double>& part) {
  // A roll-back that came while an earlier try of this update waited is still to be handled.
  for (const Incoming& in : deferred_)
    if (undoes_clock(in)) throw UpdateAbandoned{};
  const std::string name = round_kind_name(kind);
  const nlohmann::json report = {{"version", version}, {"clock", clock},
                                 {"generation", generation}, {"kind", name},
                                 {"part", part}};
  using Clock = std::chrono::steady_clock;
  auto sent = Clock::now() - std::chrono::hours(1);
  for (;;) {
    if (std::chrono::duration<double>(Clock::now() - sent).count() >= link_.heartbeat_timeout()) {
      send(link_.socket(), json_frame(Kind::NormReport, link_.node_id(), report));
      sent = Clock::now();
    }
    link_.check();
    zmq::pollitem_t item{link_.socket().handle(), 0, ZMQ_POLLIN, 0};
    poll_sockets(&item, 1, 50);
    while (auto in = try_receive(link_.socket(), false, link_.rejects(), who_)) {
      const Kind k = in->header.kind_enum();
      if (k == Kind::ClipScale) {
        nlohmann::json j = in->json();
        if (j.at("version").get<int64_t>() != version ||
            j.at("generation").get<uint32_t>() != generation || j.at("kind") != name)
          continue;  // an answer to a report sent before a roll-back
        MOETRAIN_CHECK(j.at("sum").size() == part.size(),
                       "the scheduler's {} sums of update {}: {} figures, {} sent", name, version,
                       j.at("sum").size(), part.size());
        return j;
      }
      const bool undoes = undoes_clock(*in);
      deferred_.push_back(std::move(*in));
      if (undoes) {
        log_warn("{}: update {} abandoned while waiting for its global {} figures: the scheduler "
                 "sent a {}",
                 who_, version, name, kind_name(k));
        throw UpdateAbandoned{};
      }
    }
  }
}

std::vector<double> ServerRounds::sums(int64_t version, int64_t clock, uint32_t generation,
                                       RoundKind kind, const std::vector<double>& part) {
  return agree(version, clock, generation, kind, part).at("sum").get<std::vector<double>>();
}

std::optional<Incoming> ServerRounds::next_deferred() {
  if (deferred_.empty()) return std::nullopt;
  Incoming in = std::move(deferred_.front());
  deferred_.pop_front();
  return in;
}

}  // namespace moetrain::ps
