#include "optim/param_groups.h"

#include <algorithm>

namespace moetrain {

std::vector<ParamRange> param_groups(const ParamTable& layout) {
  std::vector<const ParamInfo*> sorted;
  for (const auto& p : layout.params()) sorted.push_back(&p);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  std::vector<ParamRange> groups;
  int64_t at = 0;
  for (const ParamInfo* p : sorted) {
    if (p->offset > at) groups.push_back({at, p->offset - at, false});
    groups.push_back({p->offset, p->numel, p->decay});
    at = p->offset + p->numel;
  }
  if (layout.size() > at) groups.push_back({at, layout.size() - at, false});
  return groups;
}

}  // namespace moetrain
