#include "transport/rdma/verbs_loader.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "core/params.hpp"

namespace sluice::detail::rdma {
namespace {

// Process-wide: the library is loaded once, by the first engine that starts rdma.
const Param<std::string> kIbverbsLib{"rdma.ibverbs_lib", "SLUICE_IBVERBS_LIB", "", any_text(),
                                     "libibverbs to dlopen; empty = libibverbs.so.1, then libibverbs.so",
                                     ParamScope::kProcess};

template <typename F>
bool bind(void* lib, F& fn, const char* name, std::string* missing) {
  fn = reinterpret_cast<F>(::dlsym(lib, name));
  if (!fn && missing) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return fn != nullptr;
}

}  // namespace

const Verbs* Verbs::get(std::string* why) {
  // Loaded once per process and never unloaded (providers keep threads and state).
  static std::mutex mu;
  static Verbs table;
  static bool tried = false;
  static std::string error;
  std::lock_guard<std::mutex> lk(mu);
  if (!tried) {
    tried = true;
    const std::string lib = kIbverbsLib.read();
    const char* names[] = {!lib.empty() ? lib.c_str() : "libibverbs.so.1", !lib.empty() ? nullptr : "libibverbs.so"};
    for (const char* n : names) {
      if (!n) continue;
      table.lib = ::dlopen(n, RTLD_NOW | RTLD_LOCAL);
      if (table.lib) break;
      error = std::string("libibverbs not found (") + ::dlerror() + ")";
    }
    if (table.lib) {
      std::string missing;
      void* l = table.lib;
      bind(l, table.get_device_list, "ibv_get_device_list", &missing);
      bind(l, table.free_device_list, "ibv_free_device_list", &missing);
      bind(l, table.get_device_name, "ibv_get_device_name", &missing);
      bind(l, table.open_device, "ibv_open_device", &missing);
      bind(l, table.close_device, "ibv_close_device", &missing);
      bind(l, table.query_device, "ibv_query_device", &missing);
      bind(l, table.query_port, "ibv_query_port", &missing);
      bind(l, table.query_gid, "ibv_query_gid", &missing);
      bind(l, table.alloc_pd, "ibv_alloc_pd", &missing);
      bind(l, table.dealloc_pd, "ibv_dealloc_pd", &missing);
      bind(l, table.reg_mr, "ibv_reg_mr", &missing);
      bind(l, table.reg_dmabuf_mr, "ibv_reg_dmabuf_mr", nullptr);
      bind(l, table.dereg_mr, "ibv_dereg_mr", &missing);
      bind(l, table.create_comp_channel, "ibv_create_comp_channel", &missing);
      bind(l, table.destroy_comp_channel, "ibv_destroy_comp_channel", &missing);
      bind(l, table.create_cq, "ibv_create_cq", &missing);
      bind(l, table.destroy_cq, "ibv_destroy_cq", &missing);
      bind(l, table.get_cq_event, "ibv_get_cq_event", &missing);
      bind(l, table.ack_cq_events, "ibv_ack_cq_events", &missing);
      bind(l, table.create_qp, "ibv_create_qp", &missing);
      bind(l, table.modify_qp, "ibv_modify_qp", &missing);
      bind(l, table.destroy_qp, "ibv_destroy_qp", &missing);
      bind(l, table.wc_status_str, "ibv_wc_status_str", &missing);
      bind(l, table.get_async_event, "ibv_get_async_event", &missing);
      bind(l, table.ack_async_event, "ibv_ack_async_event", &missing);
      bind(l, table.event_type_str, "ibv_event_type_str", &missing);
      if (!missing.empty()) {
        error = "libibverbs not found (the loaded library lacks " + missing + ")";
        ::dlclose(table.lib);
        table.lib = nullptr;
      }
    }
  }
  if (!table.lib) {
    if (why) *why = error;
    return nullptr;
  }
  return &table;
}

}  // namespace sluice::detail::rdma
