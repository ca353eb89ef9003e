// Included before each shared transport suite (tests/transport/*_test.cpp) to build it for
// rdma: every header those files use is included first, then `Values(...)` is redefined so
// that their INSTANTIATE_TEST_SUITE_P(Transports, X, ::testing::Values("tcp", "shm"), ...)
// instantiates X for "rdma" only (a macro never re-expands itself, so the result is the real
// ::testing::Values("rdma")).
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "loopback.hpp"
#include "sluice/sluice.hpp"

#define Values(...) Values("rdma")
