#include <pybind11/pybind11.h>
#include <cstdint>
namespace py = pybind11;
struct Obj { uint64_t v = 7; bool done() const { return v != 0; } uint64_t get() const { return v; } };
PYBIND11_MODULE(pb_trivial, m) {
  m.def("noop", [] {});
  m.def("add", [](uint64_t a, uint64_t b) { return a + b; });
  py::class_<Obj>(m, "Obj").def(py::init<>()).def("done", &Obj::done).def_property_readonly("value", &Obj::get);
}
