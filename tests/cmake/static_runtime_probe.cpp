// A shared library that uses the C++ runtime's locale machinery (an ostringstream), linked with
// the runtime static: tests/cmake/check_exports.sh reads what it exports.
#include <sstream>
#include <string>

extern "C" __attribute__((visibility("default"))) int sluice_probe_format(int v, char* out, int cap) {
  std::ostringstream os;
  os << "v=" << v;
  const std::string s = os.str();
  const int n = static_cast<int>(s.size()) < cap - 1 ? static_cast<int>(s.size()) : cap - 1;
  s.copy(out, n);
  out[n] = 0;
  return n;
}
