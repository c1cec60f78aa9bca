// Op schemas of the `kvprune` namespace (torch.ops.kvprune.*), every op's here. Device impls
// are registered in ops_cpu.cpp / ops_cuda.cpp (one Backend per device), fake impls in
// python/kvprune_cuda/_fake.py.
#include <torch/library.h>

TORCH_LIBRARY(kvprune, m) {
  m.def("window_scores(Tensor q, Tensor k, Tensor? lse, float? scale, str gqa, Tensor? seq_lens, "
        "str qreduce=\"sum\", Tensor? k_scale=None, Tensor? query_weight=None, "
        "Tensor? key_weight=None) -> Tensor");
  m.def("window_scores_out(Tensor q, Tensor k, Tensor? lse, float? scale, str gqa, Tensor? seq_lens, "
        "str qreduce, Tensor(a!) out, Tensor? k_scale=None, Tensor? query_weight=None, "
        "Tensor? key_weight=None) -> ()");
  m.def("pool_scores(Tensor scores, int kernel_size, str mode, int window, Tensor? seq_lens, "
        "int shift=0) -> Tensor");
  m.def("select_keep(Tensor scores, int budget, int n_sink, int window, Tensor? seq_lens) -> Tensor");
  m.def("gather_kv(Tensor k, Tensor v, Tensor idx) -> (Tensor, Tensor)");
  m.def("gather_kv_out(Tensor k, Tensor v, Tensor idx, Tensor(a!) out_k, Tensor(b!) out_v) -> ()");
  m.def("snapkv(Tensor q, Tensor k, Tensor v, int budget, int n_sink, int window, int kernel_size, "
        "str pool, str gqa, Tensor? lse, float? scale, Tensor? seq_lens, Tensor? k_scale=None, "
        "int pool_shift=0) -> (Tensor, Tensor, Tensor)");
  m.def("snapkv_out(Tensor q, Tensor k, Tensor v, int budget, int n_sink, int window, int kernel_size, "
        "str pool, str gqa, Tensor? lse, float? scale, Tensor? seq_lens, Tensor(a!) out_k, "
        "Tensor(b!) out_v, Tensor? k_scale=None, int pool_shift=0) -> Tensor");
  m.def("snapkv_select(Tensor q, Tensor k, int budget, int n_sink, int window, int kernel_size, "
        "str pool, str gqa, Tensor? lse, float? scale, Tensor? seq_lens, Tensor? k_scale=None, "
        "int pool_shift=0) -> Tensor");
  m.def("streaming(Tensor k, Tensor v, int budget, int n_sink, Tensor? seq_lens) -> (Tensor, Tensor, Tensor)");
  m.def("paged_window_scores(Tensor q, Tensor k_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor? lse, float? scale, str gqa, str layout, Tensor? k_scale=None) -> Tensor");
  m.def("paged_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor idx, str layout) -> Tensor");
  // decode-time ops
  m.def("streaming_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) slot_pos, "
        "Tensor(d!) seq_lens, Tensor k_new, Tensor v_new, int n_sink, Tensor? slots) -> ()");
  m.def("rerotate_keys(Tensor(a!) k, Tensor old_pos, Tensor new_pos, float theta, int rotary_dim, "
        "str layout, Tensor? inv_freq) -> ()");
  m.def("decode_scores(Tensor q, Tensor k_cache, Tensor slot_pos, Tensor seq_lens, "
        "Tensor(a!)? h2o_scores, float? scale, str gqa, Tensor? v_cache) -> Tensor");
  m.def("h2o_evict(Tensor(a!) h2o_scores, Tensor(b!) slot_pos, Tensor seq_lens, int n_sink, "
        "int recent, int num) -> Tensor");
  m.def("gather_kv_rope(Tensor k, Tensor v, Tensor idx, float theta, int rotary_dim, str layout, "
        "Tensor? inv_freq) -> (Tensor, Tensor)");
  m.def("gather_kv_rope_out(Tensor k, Tensor v, Tensor idx, Tensor(a!) out_k, Tensor(b!) out_v, "
        "float theta, int rotary_dim, str layout, Tensor? inv_freq) -> ()");
}
