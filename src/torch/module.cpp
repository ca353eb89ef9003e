// sluice._sluice_torch: the pybind11 module behind `import sluice.torch`. Built with torch's
// own pybind11 headers so that c10d::Store and c10d::Backend cross the boundary as torch's
// Python objects.
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "backend.hpp"

namespace py = pybind11;
using sluice::torch_backend::SluiceBackend;

PYBIND11_MODULE(_sluice_torch, m) {
  m.doc() = "torch.distributed backend 'sluice' (CPU and CUDA tensors)";
  py::module_::import("torch.distributed");  // registers c10d.Store and c10d.Backend
  py::class_<SluiceBackend, c10d::Backend, c10::intrusive_ptr<SluiceBackend>>(m, "SluiceBackend")
      .def_property_readonly("transport", &SluiceBackend::transport,
                             "The engine transport the endpoints run (shm, tcp, ...).")
      .def_property_readonly("cuda_path", &SluiceBackend::cuda_path,
                             "How large CUDA tensors move: 'nvlink' (directly between GPUs) or 'host'.")
      .def_property_readonly("stream_p2p_state", &SluiceBackend::stream_p2p_state,
                             "The stream-ordered CUDA send/recv (SLUICE_TORCH_CUDA_PATH=stream): 'on ...', "
                             "'not set up ...', 'failed: <why>' or 'off ...'.")
      .def_property_readonly("stream_p2p_calls", &SluiceBackend::stream_p2p_calls,
                             "CUDA sends and recvs that ran as stream-ordered kernels.")
      .def_property_readonly("ll_allgather_calls", &SluiceBackend::ll_allgather_calls,
                             "all_gather calls on CUDA tensors that ran as the low-latency NVLink kernel.")
      .def_property_readonly("ll_allreduce_calls", &SluiceBackend::ll_allreduce_calls,
                             "all_reduce calls on CUDA tensors that ran through the low-latency AllGather.")
      .def_property_readonly("ll_allgather_state", &SluiceBackend::ll_allgather_state,
                             "The low-latency all_gather's state: 'on ...' or 'off: <why>'.")
      .def_property_readonly("device_collective_calls", &SluiceBackend::device_collective_calls,
                             "Collective calls on CUDA tensors (all_gather_into_tensor, all_to_all_single, broadcast) "
                             "that went GPU to GPU (SLUICE_TORCH_DEVICE_COLLECTIVES, on by default).")
      .def_property_readonly(
          "recv_ready",
          [](const SluiceBackend& b) {
            auto s = b.recv_ready_stats();
            py::dict d;
            d["offered"] = s.offered;
            d["used"] = s.used;
            d["voided"] = s.voided;
            return d;
          },
          "Ready-to-receive counts: RTRs this rank offered as a receiver, used and voided as a sender.");
  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
        return c10::make_intrusive<SluiceBackend>(store, rank, size, timeout);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>(),
      "Bootstraps the engine through `store` and connects to every rank (blocks until all did).");
}
