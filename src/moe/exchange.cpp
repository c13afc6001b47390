#include "moe/exchange.h"

#include "core/check.h"

namespace moetrain {

void LocalExchange::plan(ExchangeLayout& layout, const int64_t* counts, int64_t E, int64_t C) {
  MOETRAIN_CHECK(E >= 1 && C >= 1, "LocalExchange::plan: E = {}, C = {}: both must be positive",
                 E, C);
  layout.P = 1, layout.E_local = E, layout.C = C;
  layout.recv_counts.assign(counts, counts + E);
  layout.expert_counts = layout.recv_counts;
  int64_t R = 0;
  for (int64_t e = 0; e < E; ++e) R += counts[e];
  layout.R_send = layout.R_recv = R;
  layout.send_rows.assign(1, R);
  layout.recv_rows.assign(1, R);
  layout.recv_offset = {0, R};
  layout.rows.clear();
}

}  // namespace moetrain
