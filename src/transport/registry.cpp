#include "transport/transport.hpp"

namespace sluice::detail {

std::vector<TransportFactory>& transport_factories() {
  static std::vector<TransportFactory> factories;
  return factories;
}

bool register_transport(TransportFactory factory) {
  transport_factories().push_back(std::move(factory));
  return true;
}

}  // namespace sluice::detail
