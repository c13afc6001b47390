#include <gtest/gtest.h>

#include <vector>

#include "core/check.h"
#include "moe/slot_routing.h"

using namespace moetrain;

namespace {

// N tokens, S = 2 routing positions, over 4 experts.
Routing routing(std::vector<int32_t> expert) {
  Routing r;
  r.E = 4, r.S = 2, r.N = static_cast<int64_t>(expert.size()) / 2;
  r.selected = expert;
  r.expert = expert;
  r.weight.assign(expert.size(), 0.5f);
  return r;
}

}  // namespace

TEST(SlotRouting, SplitsEachExpertContiguouslyInTokenOrder) {
  // 2 ranks, 2 experts + 1 spare each: expert 0 on slots 0 and 5, expert 3 on slots 4 and 2.
  Placement p{4, 2, 3, {0, 1, 3, 2, 3, 0}};
  // Expert 0 has 5 assignments: slot 0 takes the first 2 (5·1/2), slot 5 the last 3; expert 3
  // has 2: one each, slot 2 first (slots ascending); a dropped one stays dropped.
  Routing r = routing({0, 3, 0, 1, 0, -1, 3, 0, 2, 0});
  r.selected[5] = 2;
  Routing out;
  route_to_slots(out, r, p);
  EXPECT_EQ(out.E, 6);
  EXPECT_EQ(out.expert, (std::vector<int32_t>{0, 2, 0, 1, 5, -1, 4, 5, 3, 5}));
  EXPECT_EQ(out.selected[5], 3);  // the dropped assignment names expert 2's first slot
  EXPECT_EQ(out.weight, r.weight);

  std::vector<int64_t> per_slot = {2, 1, 1, 1, 1, 3}, per_expert(4);
  slot_counts_to_experts(per_expert.data(), per_slot.data(), p);
  EXPECT_EQ(per_expert, (std::vector<int64_t>{5, 1, 1, 2}));
}

TEST(SlotRouting, StaticPlacementOnlyRenumbers) {
  const Placement p = static_placement(4, 2, 1);  // 0 1 - 2 3 -
  Routing out;
  route_to_slots(out, routing({0, 1, 2, 3}), p);
  EXPECT_EQ(out.expert, (std::vector<int32_t>{0, 1, 3, 4}));
}

TEST(SlotRouting, RejectsAnotherExpertCount) {
  Routing out;
  EXPECT_THROW(route_to_slots(out, routing({0, 1}), static_placement(6, 2, 1)), Error);
}
