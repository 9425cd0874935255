#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dlpack_view.h"
#include "int_args.h"
#include "pyspec/block_manager.h"
#include "pyspec/check.h"
#include "pyspec/tensor_view.h"
#include "registry.h"
#include "uninitialized.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {
void RegisterBlockManager(py::module_& m) {
  using BM = BlockManager;
  py::class_<BM>(m, "BlockManager", R"doc(
Paged-KV block manager with a prefix cache (block ids, block tables, refcounts; no tensors).

The KV pool ``[num_blocks, block_size, kv_heads, head_dim]`` per layer is owned by the caller; this
object decides which block holds which request's tokens. Full computed blocks are cached under a
chained hash of their tokens and reused by later prompts; unreferenced cached blocks are evicted
least-recently-used first. Draft tokens never get blocks: only accepted tokens are committed.
Pool exhaustion is reported by return values (``add_request`` -> -1, ``reserve``/``commit`` ->
False); bad arguments raise ValueError naming the argument.
)doc")
      .def(py::init([](py::handle num_blocks, py::handle block_size, bool enable_prefix_cache) {
             const int64_t n = IntArg(num_blocks, "num_blocks");
             const int64_t bs = IntArg(block_size, "block_size");
             // (the core checks the range; this only keeps the value intact through the cast)
             PYSPEC_CHECK(bs == static_cast<int>(bs), "block_size must be in [1, 65536]; got ", bs);
             return new BM(n, static_cast<int>(bs), enable_prefix_cache);
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::arg("enable_prefix_cache") = true,
           "num_blocks >= 1 blocks of block_size (1..65536) token slots each (ints; a bad one "
           "raises ValueError naming it).")
      .def_readonly_static("NO_SPACE", &BM::kNoSpace)
      .def(
          "add_request",
          [](BM& bm, py::handle request_id, py::handle prompt) {
            const int64_t id = IntArg(request_id, "request_id");
            std::vector<int32_t> tokens = TokensArg(prompt, "prompt");
            return bm.AddRequest(id, tokens);
          },
          py::arg("request_id"), py::arg("prompt"),
          "Register a request and allocate blocks for its prompt (list of ints or 1-D int32/int64 "
          "tensor, >= 1 token). Returns the number of prompt tokens whose KV is already cached "
          "(a multiple of block_size, never the whole prompt), or -1 (NO_SPACE) when the pool "
          "cannot hold it; then nothing changed.")
      .def("reserve", &BM::Reserve, py::arg("request_id"), py::arg("num_extra_tokens"),
           "Make private blocks cover positions [num_computed, num_tokens + num_extra_tokens) "
           "(copy-on-write after fork). Returns False, changing nothing, if the pool is exhausted.")
      .def("can_reserve", &BM::CanReserve, py::arg("request_id"), py::arg("num_extra_tokens"),
           "Whether reserve(request_id, num_extra_tokens) would succeed now.")
      .def("blocks_needed_to_reserve", &BM::BlocksNeededToReserve, py::arg("request_id"),
           py::arg("num_extra_tokens"),
           "Blocks reserve(request_id, num_extra_tokens) would take from the pool.")
      .def(
          "commit",
          [](BM& bm, int64_t request_id, py::handle tokens, int64_t num_computed) {
            std::vector<int32_t> t = TokensArg(tokens, "tokens");
            return bm.Commit(request_id, t, num_computed);
          },
          py::arg("request_id"), py::arg("tokens"), py::arg("num_computed") = 0,
          "Append accepted tokens (list or 1-D int tensor), allocating blocks as needed, then "
          "advance num_computed by `num_computed` (the positions materialized this step). "
          "Returns False, changing nothing, if the pool is exhausted.")
      .def("mark_computed", &BM::MarkComputed, py::arg("request_id"), py::arg("n"),
           "The KV of the next n tokens is in the pages (after a prefill chunk or materialize). "
           "Newly full blocks enter the prefix cache.")
      .def(
          "slots_for",
          [](const BM& bm, int64_t request_id, int64_t start, int64_t n,
             py::object out) -> py::object {
            if (out.is_none()) return py::cast(bm.SlotsFor(request_id, start, n));
            PYSPEC_CHECK(n >= 0, "n must be >= 0; got ", n);
            TensorView v = ToView(out, "out");
            CheckDevice(v, "out", DeviceType::kCPU);
            CheckDType(v, "out", {DType::kInt64});
            PYSPEC_CHECK(v.ndim == 1 && v.shape[0] >= n && v.strides[0] == 1,
                         "'out' must be a contiguous 1-D tensor of at least n = ", n,
                         " elements; got shape ", v.ShapeString());
            bm.SlotsFor(request_id, start, n, v.ptr<int64_t>());
            return out;
          },
          py::arg("request_id"), py::arg("start"), py::arg("n"), py::arg("out") = py::none(),
          "Flat slot ids block_table[p // block_size] * block_size + p % block_size for positions "
          "p in [start, start + n), within the reserved capacity. Returns a list, or fills and "
          "returns `out` (1-D contiguous int64 CPU tensor with >= n elements).")
      .def("fork", &BM::Fork, py::arg("parent_id"), py::arg("child_id"),
           "Register child_id sharing all of parent_id's blocks, tokens and progress "
           "(copy-on-write on the next reserve/commit).")
      .def("free", &BM::Free, py::arg("request_id"),
           "Release the request's blocks; cached ones stay cached as evictable.")
      .def("take_pending_copies", &BM::TakePendingCopies,
           "Pending copy-on-write copies [(src_block, dst_block), ...], oldest first; clears them. "
           "Copy every layer's K and V block src -> dst, in order, before writing dst.")
      .def("peek_pending_copies", &BM::PeekPendingCopies,
           "The pending copies without clearing them.")
      .def("reset_prefix_cache", &BM::ResetPrefixCache,
           "Drop every unreferenced cached block; returns how many were dropped.")
      .def("reset_counters", &BM::ResetCounters, "Zero prefix_queries and prefix_hits.")
      .def("has_request", &BM::HasRequest, py::arg("request_id"),
           "Whether request_id is registered.")
      .def("__contains__", &BM::HasRequest, py::arg("request_id"))
      .def("block_table", &BM::BlockTable, py::arg("request_id"),
           "The request's block ids (a copy), one per block_size positions.")
      .def("tokens", &BM::Tokens, py::arg("request_id"), "The request's known tokens (a copy).")
      .def("num_tokens", &BM::NumTokens, py::arg("request_id"),
           "Tokens known for the request (prompt + committed).")
      .def("num_computed", &BM::NumComputed, py::arg("request_id"),
           "Tokens whose KV is materialized in the pages.")
      .def("capacity", &BM::Capacity, py::arg("request_id"),
           "Token positions covered by the request's blocks.")
      .def("ref_count", &BM::RefCount, py::arg("block"),
           "References to a block (block tables + pending copies reading it).")
      .def("is_cached", &BM::IsCached, py::arg("block"), "Whether a block is in the prefix cache.")
      .def("check_invariants", &BM::CheckInvariants,
           "Verify all internal invariants (no leak, refcounts, hash chain, LRU order); raises "
           "RuntimeError naming the first violation. For tests.")
      .def_property_readonly("block_size", &BM::block_size)
      .def_property_readonly("prefix_cache_enabled", &BM::prefix_cache_enabled)
      .def_property_readonly("num_requests", &BM::num_requests)
      .def_property_readonly("num_total_blocks", &BM::num_total_blocks)
      .def_property_readonly("num_free_blocks", &BM::num_free_blocks,
                             "Blocks an allocation can take: free + evictable cached.")
      .def_property_readonly("num_evictable_blocks", &BM::num_evictable_blocks)
      .def_property_readonly("num_used_blocks", &BM::num_used_blocks)
      .def_property_readonly("num_cached_blocks", &BM::num_cached_blocks)
      .def_property_readonly("num_pending_copies", &BM::num_pending_copies)
      .def_property_readonly("usage_ratio", &BM::usage_ratio, "num_used_blocks / num_total_blocks.")
      .def_property_readonly("prefix_queries", &BM::prefix_queries,
                             "Prompt tokens looked up in the prefix cache (admitted requests).")
      .def_property_readonly("prefix_hits", &BM::prefix_hits,
                             "Prompt tokens found cached (sum of add_request results).")
      .def_property_readonly("hit_ratio", &BM::hit_ratio,
                             "prefix_hits / prefix_queries (0 if none).")
      .def("__len__", &BM::num_requests)
      .def("__repr__", [](const BM& bm) {
        return detail::StrCat("BlockManager(num_blocks=", bm.num_total_blocks(),
                              ", block_size=", bm.block_size(), ", used=", bm.num_used_blocks(),
                              ", free=", bm.num_free_blocks(), ", cached=", bm.num_cached_blocks(),
                              ", requests=", bm.num_requests(), ")");
      });
  RefuseUninitialized<BM>();
}

}  // namespace bindings
}  // namespace pyspec
