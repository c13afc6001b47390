// Activation recomputation (train.recompute): what the forward keeps for the backward, and what
// the backward computes again. Every mode gives the same gradients, bit for bit: a recompute runs
// the same operations on the same inputs, and replays the forward's routing instead of routing
// again.
//   none: every block keeps its activations and every MoE layer its expert intermediates.
//   moe:  the MoE layers drop their experts' (and shared experts') intermediates — the up-
//         projections and SwiGLU outputs per assignment — after the forward, and compute them
//         again from the rows they kept, right before each expert's backward (no second exchange).
//   full: the model keeps only each block's input; the backward runs each block's forward again
//         (last block first) right before its backward, the MoE layers replaying their recorded
//         routing and exchanging the rows again.
#pragma once
#include <string>

#include "core/check.h"

namespace moetrain {

enum class Recompute { None, Moe, Full };

inline const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Moe: return "moe";
    case Recompute::Full: return "full";
  }
  return "?";
}

inline Recompute parse_recompute(const std::string& name) {
  for (Recompute r : {Recompute::None, Recompute::Moe, Recompute::Full})
    if (name == recompute_name(r)) return r;
  MOETRAIN_FAIL("train.recompute = '{}': allowed are none, moe, full", name);
}

}  // namespace moetrain
