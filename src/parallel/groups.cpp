#include "parallel/groups.h"

#include "core/check.h"

namespace moetrain {

ParallelLayout make_parallel_layout(int world, int rank, int ep, int etp) {
  MOETRAIN_CHECK(world >= 1 && rank >= 0 && rank < world, "rank {} outside a world of {}", rank,
                 world);
  MOETRAIN_CHECK(ep >= 1 && world % ep == 0,
                 "expert parallelism --ep {} must divide the number of processes {} (world = DP "
                 "× EP)",
                 ep, world);
  MOETRAIN_CHECK(etp >= 1 && world % (ep * etp) == 0,
                 "dist.ep = {} × dist.etp = {} does not divide the number of processes {} (world "
                 "= expert data parallel × ep × etp); use an ep · etp that divides {}",
                 ep, etp, world, world);
  ParallelLayout l;
  l.world = world, l.rank = rank, l.ep = ep, l.dp = world / ep, l.etp = etp;
  l.etp_index = rank % etp;
  l.ep_index = (rank / etp) % ep;
  l.dp_index = rank / (etp * ep) * etp + l.etp_index;
  return l;
}

ExpertShard expert_shard(int64_t E, int ep, int ep_index) {
  MOETRAIN_CHECK(ep >= 1 && E % ep == 0,
                 "expert parallelism --ep {} must divide model.n_experts = {} (each rank owns "
                 "n_experts / ep experts)",
                 ep, E);
  MOETRAIN_CHECK(ep_index >= 0 && ep_index < ep, "EP index {} outside [0, {})", ep_index, ep);
  const int64_t per = E / ep;
  return {ep_index * per, per};
}

ProcessGroups make_process_groups(Comm& world, int ep, int etp) {
  ProcessGroups g;
  g.layout = make_parallel_layout(world.size(), world.rank(), ep, etp);
  const ParallelLayout& l = g.layout;
  g.control = world.dup("control");
  g.moe_stats = world.dup("moe_stats");
  g.grads = world.dup("grads");
  g.expert_grads = world.split(l.ep_index, l.dp_index, {"expert_grads"});
  g.a2a = world.split(l.dp_index, l.ep_index, {"a2a"});
  if (etp > 1) g.etp = world.split(l.rank / etp, l.etp_index, {"etp"});
  return g;
}

}  // namespace moetrain
