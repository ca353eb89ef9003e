#include "core/inline_vec.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace sluice::detail {
namespace {

TEST(InlineVec, KeepsOrderAcrossTheSpill) {
  InlineVec<std::string, 2> v;
  EXPECT_TRUE(v.empty());
  for (int i = 0; i < 7; ++i) {
    v.push_back(std::to_string(i));
    ASSERT_EQ(v.size(), static_cast<size_t>(i + 1));
    for (int j = 0; j <= i; ++j) EXPECT_EQ(v[j], std::to_string(j)) << "after " << i + 1 << " pushes";
  }
  EXPECT_EQ(v.front(), "0");
  EXPECT_EQ(v.back(), "6");
  int n = 0;
  for (auto& s : v) EXPECT_EQ(s, std::to_string(n++));
  EXPECT_EQ(n, 7);
}

TEST(InlineVec, MoveOnlyElementsAreReleasedOnClear) {
  auto token = std::make_shared<int>(1);
  InlineVec<std::shared_ptr<int>, 1> v;
  v.push_back(token);
  v.push_back(token);  // spills
  EXPECT_EQ(token.use_count(), 3);
  v.clear();
  EXPECT_EQ(token.use_count(), 1) << "clear() must drop the inline copy too";
  EXPECT_TRUE(v.empty());
  v.push_back(token);
  EXPECT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].get(), token.get());
}

TEST(InlineVec, ResizeBothWays) {
  InlineVec<int, 2> v(2);
  EXPECT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0], 0);
  v[1] = 5;
  v.resize(5);
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v[1], 5);
  EXPECT_EQ(v[4], 0);
  v.resize(1);
  EXPECT_EQ(v.size(), 1u);
  v.resize(0);
  EXPECT_TRUE(v.empty());
  v.push_back(9);
  EXPECT_EQ(v.back(), 9);
}

}  // namespace
}  // namespace sluice::detail
