// Instantiates the shared in-process transport suite (tests/transport/loopback_test.cpp, the
// checks tcp and shm pass) for rdma. tests/rdma/run.sh runs it in the SoftRoCE guest with
// --gtest_filter='Rdma/*'.
#include "loopback.hpp"

namespace sluice_test {
INSTANTIATE_TEST_SUITE_P(Rdma, LoopbackTest, ::testing::Values("rdma"), transport_name);
}  // namespace sluice_test
