// libibverbs, loaded at run time with dlopen: libsluice has no link-time dependency on
// rdma-core, so it loads (and the rdma transport reports "libibverbs not found") on hosts
// without it. Only the types and the inline data-path helpers of <infiniband/verbs.h> are
// used (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq go through the
// provider's ops table); every exported function is called through this table.
#pragma once

#include <infiniband/verbs.h>

#include <string>

namespace sluice::detail::rdma {

struct Verbs {
  void* lib = nullptr;
  decltype(&::ibv_get_device_list) get_device_list = nullptr;
  decltype(&::ibv_free_device_list) free_device_list = nullptr;
  decltype(&::ibv_get_device_name) get_device_name = nullptr;
  decltype(&::ibv_open_device) open_device = nullptr;
  decltype(&::ibv_close_device) close_device = nullptr;
  decltype(&::ibv_query_device) query_device = nullptr;
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*) = nullptr;  // the 1.1 symbol
  decltype(&::ibv_query_gid) query_gid = nullptr;
  decltype(&::ibv_alloc_pd) alloc_pd = nullptr;
  decltype(&::ibv_dealloc_pd) dealloc_pd = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int) = nullptr;
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;  // optional (rdma-core >= 34)
  decltype(&::ibv_dereg_mr) dereg_mr = nullptr;
  decltype(&::ibv_create_comp_channel) create_comp_channel = nullptr;
  decltype(&::ibv_destroy_comp_channel) destroy_comp_channel = nullptr;
  decltype(&::ibv_create_cq) create_cq = nullptr;
  decltype(&::ibv_destroy_cq) destroy_cq = nullptr;
  decltype(&::ibv_get_cq_event) get_cq_event = nullptr;
  decltype(&::ibv_ack_cq_events) ack_cq_events = nullptr;
  decltype(&::ibv_create_qp) create_qp = nullptr;
  decltype(&::ibv_modify_qp) modify_qp = nullptr;
  decltype(&::ibv_destroy_qp) destroy_qp = nullptr;
  decltype(&::ibv_wc_status_str) wc_status_str = nullptr;
  // Port up/down events (Rails' health monitor).
  decltype(&::ibv_get_async_event) get_async_event = nullptr;
  decltype(&::ibv_ack_async_event) ack_async_event = nullptr;
  decltype(&::ibv_event_type_str) event_type_str = nullptr;

  // The process-wide table, or nullptr with *why ("libibverbs not found: ...").
  // SLUICE_IBVERBS_LIB overrides the library name (tests use it to force the failure path).
  static const Verbs* get(std::string* why);
};

}  // namespace sluice::detail::rdma
