// Shared progress (progress_pool.hpp): endpoints cost descriptors, not threads. 64 tcp
// endpoints between two engines of one process stay under the bar for one engine
// (2 x cores + 16 threads), and every endpoint still moves data.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "../harness.hpp"
#include "../raw_peer.hpp"
#include "sluice/sluice.hpp"

using namespace std::chrono_literals;
using namespace sluice_test;

TEST(ProgressScale, SixtyFourTcpEndpointsStayUnderTheThreadBar) {
  sluice::Engine a(engine_config("tcp", 2, 10s));
  sluice::Engine b(engine_config("tcp", 2, 10s));
  std::vector<uint8_t> src(4096, 0x3c), dst(64 * 64, 0);
  auto hs = a.register_memory(src.data(), src.size());
  b.register_memory(dst.data(), dst.size(), sluice::Location::host(), "dst");
  std::vector<sluice::Endpoint> eps, accepted;
  for (int i = 0; i < 64; ++i) {
    eps.push_back(a.connect(b.local_info()));
    auto acc = b.accept(5s);
    ASSERT_TRUE(acc.has_value()) << "endpoint " << i << " was not accepted";
    accepted.push_back(*acc);
  }
  std::vector<sluice::Future> fs;
  for (int i = 0; i < 64; ++i) {
    auto rh = eps[i].remote_region("dst");
    ASSERT_TRUE(rh.has_value());
    fs.push_back(eps[i].write({{hs, 0, *rh, static_cast<uint64_t>(i) * 64, 64}}));
  }
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok());
  for (size_t i = 0; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0x3c) << "byte " << i;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int bar = 2 * cores + 16;
  // Two engines live here (and the test runner's threads): the bar holds for both together.
  EXPECT_LE(thread_count(), bar) << "64 tcp endpoints (2 channels each, both ends in this process) made "
                                 << thread_count() << " threads; the bar for one engine is " << bar;
}
