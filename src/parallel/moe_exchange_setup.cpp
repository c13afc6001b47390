#include "parallel/moe_exchange_setup.h"

namespace moetrain {

ExpertParallelSetup make_expert_parallel(const ExpertParallelOptions& opts, ProcessGroups& groups) {
  ExpertParallelSetup s;
  A2aRoute route{groups.a2a.get()};
  if (opts.hierarchical) {
    s.hierarchy = std::make_unique<A2aHierarchy>(make_a2a_hierarchy(*groups.a2a, opts.ranks_per_node));
    route = s.hierarchy->route(*groups.a2a);
  }
  MpiExchangeOptions ex;
  ex.chunks = opts.chunks;
  ex.wire = opts.wire;
  ex.ranks_per_node = opts.ranks_per_node;
  if (opts.chunks > 1 || opts.overlap) {
    s.comm_thread = std::make_unique<CommThread>();
    ex.thread = s.comm_thread.get();
  }
  s.exchange = std::make_unique<MpiExchange>(route, ex);
  return s;
}

}  // namespace moetrain
