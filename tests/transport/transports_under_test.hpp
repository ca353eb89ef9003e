// Which transports the shared conformance suites (loopback, bad_input, integration,
// peer_loss: instantiated as Conformance/<Suite>/<transport>) run over.
//
// SLUICE_TEST_TRANSPORTS=rdma (comma separated) overrides; that is how the SoftRoCE guest runs
// them over rdma and the GPU machine over nvlink, from the same binaries. A name the engine
// cannot run is kept, so its tests fail at connect with the transport's own reason instead of
// silently vanishing. Without the variable: every transport a default engine offers here.
//
// Evaluated when GoogleTest registers the parameterised tests (inside main), not at static
// initialisation.
#pragma once

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "sluice/sluice.hpp"

namespace sluice_test {

inline std::vector<std::string> transports_under_test() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("SLUICE_TEST_TRANSPORTS"); env && *env) {
    std::stringstream ss(env);
    for (std::string name; std::getline(ss, name, ',');)
      if (!name.empty()) out.push_back(name);
    return out;
  }
  sluice::EngineConfig config;
  config.log_level = sluice::LogLevel::kError;
  sluice::Engine probe(config);
  return probe.transports();
}

}  // namespace sluice_test
