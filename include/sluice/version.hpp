#pragma once

namespace sluice {
inline constexpr const char* kVersion = "0.1.0";
inline constexpr int kWireVersion = 1;
}  // namespace sluice
