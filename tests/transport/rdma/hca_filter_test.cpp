#include "transport/rdma/hca_filter.hpp"

#include <gtest/gtest.h>

#include "sluice/error.hpp"

using sluice::detail::rdma::HcaFilter;

TEST(HcaFilter, EmptySelectsEverything) {
  auto f = HcaFilter::parse("");
  EXPECT_TRUE(f.matches("mlx5_0", 1));
  EXPECT_TRUE(f.matches("rxe0", 2));
}

TEST(HcaFilter, PrefixMatch) {
  auto f = HcaFilter::parse("mlx5");
  EXPECT_TRUE(f.matches("mlx5_0", 1));
  EXPECT_TRUE(f.matches("mlx5_12", 1));
  EXPECT_FALSE(f.matches("mlx4_0", 1));
  EXPECT_FALSE(f.matches("rxe0", 1));
}

TEST(HcaFilter, ExactList) {
  auto f = HcaFilter::parse("=mlx5_0,mlx5_1");
  EXPECT_TRUE(f.matches("mlx5_0", 1));
  EXPECT_TRUE(f.matches("mlx5_1", 1));
  EXPECT_FALSE(f.matches("mlx5_10", 1));
  EXPECT_FALSE(f.matches("mlx5_2", 1));
}

TEST(HcaFilter, Exclude) {
  auto f = HcaFilter::parse("^mlx5_3");
  EXPECT_TRUE(f.matches("mlx5_0", 1));
  EXPECT_FALSE(f.matches("mlx5_3", 1));
  EXPECT_FALSE(f.matches("mlx5_30", 1));  // prefix
}

TEST(HcaFilter, ExcludeExact) {
  auto f = HcaFilter::parse("^=mlx5_3");
  EXPECT_FALSE(f.matches("mlx5_3", 1));
  EXPECT_TRUE(f.matches("mlx5_30", 1));
  EXPECT_TRUE(f.matches("rxe0", 1));
}

TEST(HcaFilter, Ports) {
  auto f = HcaFilter::parse("mlx5_0:1,mlx5_1:2");
  EXPECT_TRUE(f.matches("mlx5_0", 1));
  EXPECT_FALSE(f.matches("mlx5_0", 2));
  EXPECT_TRUE(f.matches("mlx5_1", 2));
  EXPECT_FALSE(f.matches("mlx5_1", 1));
  auto g = HcaFilter::parse("^=rxe0:2");
  EXPECT_TRUE(g.matches("rxe0", 1));
  EXPECT_FALSE(g.matches("rxe0", 2));
}

TEST(HcaFilter, WhitespaceAndRoundTrip) {
  auto f = HcaFilter::parse("  =mlx5_0 , mlx5_1:1 ");
  EXPECT_TRUE(f.exact);
  ASSERT_EQ(f.entries.size(), 2u);
  EXPECT_EQ(f.entries[1].port, 1);
  EXPECT_EQ(f.to_string(), "=mlx5_0,mlx5_1:1");
  EXPECT_EQ(HcaFilter::parse("^=a,b:2").to_string(), "^=a,b:2");
}

TEST(HcaFilter, Malformed) {
  EXPECT_THROW(HcaFilter::parse("^"), sluice::Error);
  EXPECT_THROW(HcaFilter::parse("^="), sluice::Error);
  EXPECT_THROW(HcaFilter::parse("mlx5_0,,mlx5_1"), sluice::Error);
  EXPECT_THROW(HcaFilter::parse("mlx5_0:"), sluice::Error);
  EXPECT_THROW(HcaFilter::parse("mlx5_0:x"), sluice::Error);
  EXPECT_THROW(HcaFilter::parse("mlx5_0:0"), sluice::Error);
  EXPECT_THROW(HcaFilter::parse(":1"), sluice::Error);
  try {
    HcaFilter::parse("mlx5_0:abc");
    FAIL();
  } catch (const sluice::Error& e) {
    EXPECT_EQ(e.code(), sluice::ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("abc"), std::string::npos);
  }
}
