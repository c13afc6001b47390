#include "parallel/moe_exchange_setup.h"

#include "core/check.h"
#include "parallel/comm_on_thread.h"

namespace moetrain {

ExpertParallelSetup make_expert_parallel(const ExpertParallelOptions& opts, ProcessGroups& groups) {
  ExpertParallelSetup s;
  A2aRoute route{groups.a2a.get()};
  if (opts.hierarchical || opts.adaptive) {
    s.hierarchy = std::make_unique<A2aHierarchy>(make_a2a_hierarchy(*groups.a2a, opts.ranks_per_node));
    route = s.hierarchy->route(*groups.a2a);
    MOETRAIN_CHECK(!opts.adaptive || s.hierarchy->inter->size() > 1,
                   "dist.adaptive_route = true: the {} ranks of the expert-parallel group are on "
                   "one node ({}), so no rows cross nodes; set dist.ranks_per_node to the node "
                   "size, or turn the adaptive route off",
                   groups.a2a->size(),
                   opts.ranks_per_node > 0 ? "dist.ranks_per_node" : "detected");
  }
  MpiExchangeOptions ex;
  ex.chunks = opts.chunks;
  ex.wire = opts.wire;
  ex.ranks_per_node = opts.ranks_per_node;
  ex.adaptive = opts.adaptive;
  if (opts.chunks > 1 || opts.overlap) {
    s.comm_thread = std::make_unique<CommThread>();
    ex.thread = s.comm_thread.get();
  }
  s.exchange = std::make_unique<MpiExchange>(route, ex);
  if (groups.etp) {
    std::unique_ptr<Comm> etp = groups.etp->dup("etp_rows");
    s.etp = s.comm_thread ? comm_on_thread(std::move(etp), *s.comm_thread) : std::move(etp);
  }
  return s;
}

}  // namespace moetrain
