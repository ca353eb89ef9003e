// Uses Sluice only through its installed package: two engines, a registered region each, a
// tcp connection, a write whose bytes are checked, and a sluice::Error caught from a bad call
// (its type info must cross the library boundary). Exit status 0 only if all of that holds.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <sluice/sluice.hpp>

namespace {

int fail(const std::string& what) {
  std::fprintf(stderr, "sluice_consumer: FAIL: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main() try {
  sluice::EngineConfig config;
  config.transports = {"tcp"};
  sluice::Engine a(config), b(config);

  std::vector<unsigned char> src(1 << 20), dst(src.size(), 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  sluice::MemoryHandle hs = a.register_memory(src.data(), src.size());
  b.register_memory(dst.data(), dst.size(), sluice::Location::host(), "dst");

  sluice::ConnectOptions options;
  options.transport = "tcp";
  sluice::Endpoint ep = a.connect(b.listen_address(), options);
  auto remote = ep.remote_region("dst");
  if (!remote) return fail("the peer's region 'dst' is not visible");
  sluice::Status st = ep.write({{hs, 0, *remote, 0, src.size()}}).wait();
  if (!st.ok()) return fail("write: " + st.to_string());
  if (std::memcmp(src.data(), dst.data(), src.size()) != 0) return fail("the written bytes differ");

  // A caller error must arrive as sluice::Error with its code, not as an unknown exception.
  bool caught = false;
  try {
    ep.write({{sluice::MemoryHandle{999999}, 0, *remote, 0, 1}});
  } catch (const sluice::Error& e) {
    caught = e.code() == sluice::ErrorCode::kUnknownHandle;
    if (!caught) return fail(std::string("unexpected error code: ") + e.what());
  }
  if (!caught) return fail("a write from an unknown handle did not throw sluice::Error");

  std::printf("sluice_consumer: ok (sluice %s, %zu bytes over %s)\n", sluice::kVersion, src.size(),
              ep.transport().c_str());
  ep.close();
  return 0;
} catch (const std::exception& e) {
  return fail(std::string("exception: ") + e.what());
}
