// The optimizer's view of a model's parameter table: every tensor with its decay flag.
#pragma once
#include <vector>

#include "model/params.h"
#include "optim/optimizer.h"

namespace moetrain {

// Every tensor of the table with its decay flag, and the alignment gaps between tensors as
// no-decay filler, so the groups tile the whole buffer.
std::vector<ParamRange> param_groups(const ParamTable& layout);

}  // namespace moetrain
