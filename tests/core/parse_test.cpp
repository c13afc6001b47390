#include "core/parse.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace moetrain {
namespace {

TEST(Parse, WholeNumbersAreAllOfTheText) {
  EXPECT_EQ(parse_whole("0"), int64_t{0});
  EXPECT_EQ(parse_whole("4096"), int64_t{4096});
  EXPECT_EQ(parse_whole("-4"), int64_t{-4});
  EXPECT_EQ(parse_whole("9223372036854775807"), INT64_MAX);
  for (const char* bad : {"", " 2", "2 ", "3x", "1.5", "+2", "-", "0x10", "9223372036854775808"})
    EXPECT_FALSE(parse_whole(bad).has_value()) << "'" << bad << "'";
}

TEST(Parse, ListsSplitOnCommasAndOptionallySpaces) {
  using V = std::vector<std::string>;
  EXPECT_EQ(split_list("8,4096"), (V{"8", "4096"}));
  EXPECT_EQ(split_list("8,,16"), (V{"8", "", "16"}));  // the empty item is the caller's to refuse
  EXPECT_EQ(split_list("8,16,"), (V{"8", "16"}));
  EXPECT_EQ(split_list(""), V{});
  EXPECT_EQ(split_list(" 1, 2  3,", /*spaces=*/true), (V{"1", "2", "3"}));
  EXPECT_EQ(split_list(" ", /*spaces=*/true), V{});
}

}  // namespace
}  // namespace moetrain
