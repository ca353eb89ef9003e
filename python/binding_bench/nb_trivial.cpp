#include <nanobind/nanobind.h>
#include <cstdint>
namespace nb = nanobind;
struct Obj { uint64_t v = 7; bool done() const { return v != 0; } uint64_t get() const { return v; } };
NB_MODULE(nb_trivial, m) {
  m.def("noop", [] {});
  m.def("add", [](uint64_t a, uint64_t b) { return a + b; });
  nb::class_<Obj>(m, "Obj").def(nb::init<>()).def("done", &Obj::done).def_prop_ro("value", &Obj::get);
}
