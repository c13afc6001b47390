// Everything expert parallelism needs besides the MoE layers themselves, built in one place from
// the run's dist settings: the route of the token all-to-all (flat, or 2-D over nodes), the
// communication thread (chunked exchanges, and gradient reduction during backward, share it:
// MPI runs SERIALIZED) and the MPI expert exchange handed to the model.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>

#include "core/dtype.h"
#include "moe/moe_layer.h"
#include "parallel/alltoall.h"
#include "parallel/comm_thread.h"
#include "parallel/groups.h"
#include "parallel/mpi_exchange.h"

namespace moetrain {

struct ExpertParallelOptions {
  bool hierarchical = false;  // the 2-D all-to-all, within nodes then between them
  // > 0 sets the node size (hierarchical: of the 2-D route; always: for counting the all-to-all
  // bytes that cross nodes); with hierarchical, 0 detects.
  int ranks_per_node = 0;
  int chunks = 1;             // token chunks per exchange
  DType wire = DType::F32;    // token rows on the wire: f32 or bf16
  // A communication thread even with one chunk (gradient buckets reduced during backward).
  bool overlap = false;
  // The adaptive route (parallel/adaptive_route.h): the 2-D communicators are built whatever
  // `hierarchical` says, and each step's cross-node rows take the cheaper path.
  std::optional<RouteChoiceOptions> adaptive;
};

struct ExpertParallelSetup {
  std::unique_ptr<A2aHierarchy> hierarchy;  // hierarchical or adaptive only
  std::unique_ptr<CommThread> comm_thread;  // chunks > 1 or overlap
  std::unique_ptr<MpiExchange> exchange;    // over the groups' EP group
  // The groups' ETP group (null when etp = 1), its collectives on the communication thread when
  // there is one (MPI runs SERIALIZED).
  std::unique_ptr<Comm> etp;
  // What the model's MoE layers run with: this exchange, statistics over groups.moe_stats.
  MoeContext context(ProcessGroups& groups) const {
    return {exchange.get(), groups.moe_stats.get(), etp.get()};
  }
};

// Collective over the groups (the 2-D route splits communicators). The groups must outlive the
// setup.
ExpertParallelSetup make_expert_parallel(const ExpertParallelOptions& opts, ProcessGroups& groups);

}  // namespace moetrain
