// What the GPU tests share: the engine configuration they all use.
#pragma once

#include "sluice/sluice.hpp"

namespace sluice_test {

// Listens on loopback only: the GPU tests never need another host.
inline sluice::EngineConfig quiet() {
  sluice::EngineConfig c;
  c.listen_host = "127.0.0.1";
  return c;
}

}  // namespace sluice_test
