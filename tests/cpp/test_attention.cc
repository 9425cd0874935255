#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../cpp/src/half.h"
#include "../../cuda/attention_plan.h"
#include "isa_expected.h"
#include "pyspec/attention.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

// One request of a step: `prefix` committed tokens, then either a causal chunk of `q_len` tokens
// (parents empty) or a tree (parents, one per node).
struct Req {
  int64_t prefix;
  int64_t q_len;
  std::vector<int32_t> parents;
};

// A random step in fp32 master copies, stored in `dtype` for the kernel.
struct Problem {
  int64_t hq, hkv, d, bs, num_blocks, max_blocks;
  DType dtype;
  std::vector<Req> reqs;
  std::vector<int64_t> q_indptr, prefix, tree_indptr;
  std::vector<int32_t> tables, parents;
  std::vector<float> q, kp, vp, kn, vn;  // exact values representable in dtype

  int64_t T() const { return q_indptr.back(); }
};

float RoundTo(float x, DType dt) {
  if (dt == DType::kBFloat16) return half::BF16ToFloat(half::FloatToBF16(x));
  if (dt == DType::kFloat16) return half::HalfToFloat(half::FloatToHalf(x));
  return x;
}

Problem MakeProblem(std::vector<Req> reqs, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                    DType dtype, uint32_t seed) {
  Problem p{hq, hkv, d, bs, 0, 1, dtype, std::move(reqs), {0}, {}, {0}, {}, {}, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  int64_t total_blocks = 0;
  for (const Req& r : p.reqs) {
    const int64_t used = (r.prefix + bs - 1) / bs;
    p.max_blocks = std::max(p.max_blocks, used + 1);
    total_blocks += used;
  }
  p.num_blocks = total_blocks + 3;  // a few unused pages
  std::vector<int32_t> perm(p.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  p.tables.assign(p.reqs.size() * p.max_blocks, -1);
  int64_t next = 0;
  for (size_t b = 0; b < p.reqs.size(); ++b) {
    const Req& r = p.reqs[b];
    for (int64_t j = 0; j < (r.prefix + bs - 1) / bs; ++j) {
      p.tables[b * p.max_blocks + j] = perm[next++];
    }
    p.q_indptr.push_back(p.q_indptr.back() + r.q_len);
    p.prefix.push_back(r.prefix);
    p.parents.insert(p.parents.end(), r.parents.begin(), r.parents.end());
    p.tree_indptr.push_back(static_cast<int64_t>(p.parents.size()));
  }
  auto fill = [&](std::vector<float>& v, int64_t n) {
    v.resize(n);
    for (float& x : v) x = RoundTo(normal(rng), dtype);
  };
  fill(p.q, p.T() * hq * d);
  fill(p.kp, p.num_blocks * bs * hkv * d);
  fill(p.vp, p.num_blocks * bs * hkv * d);
  fill(p.kn, p.T() * hkv * d);
  fill(p.vn, p.T() * hkv * d);
  return p;
}

// Storage of a float vector in a dtype.
struct Stored {
  std::vector<float> f32;
  std::vector<uint16_t> h16;
  Stored(const std::vector<float>& v, DType dt) {
    if (dt == DType::kFloat32) {
      f32 = v;
    } else {
      for (float x : v) {
        h16.push_back(dt == DType::kBFloat16 ? half::FloatToBF16(x) : half::FloatToHalf(x));
      }
    }
  }
  void* data() { return f32.empty() ? static_cast<void*>(h16.data()) : f32.data(); }
  float at(size_t i, DType dt) const {
    if (dt == DType::kFloat32) return f32[i];
    return dt == DType::kBFloat16 ? half::BF16ToFloat(h16[i]) : half::HalfToFloat(h16[i]);
  }
};

AttentionPlan Plan(const Problem& p, const AttentionPlanOptions& opt = {}) {
  const int64_t B = static_cast<int64_t>(p.reqs.size());
  auto v = [](const void* d, DType dt, std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(const_cast<void*>(d), dt, s);
  };
  return PlanAttention(v(p.q_indptr.data(), DType::kInt64, {B + 1}),
                       v(p.prefix.data(), DType::kInt64, {B}),
                       v(p.tables.data(), DType::kInt32, {B, p.max_blocks}), p.bs,
                       v(p.parents.data(), DType::kInt32, {int64_t(p.parents.size())}),
                       v(p.tree_indptr.data(), DType::kInt64, {B + 1}), p.num_blocks, opt);
}

// Runs the kernel; returns out (as floats) and lse.
void RunKernel(const Problem& p, const AttentionPlan& plan, std::vector<float>* out,
         std::vector<float>* lse, ThreadPool* pool = nullptr,
         const LinearKernels* kernels = nullptr) {
  const int64_t T = p.T();
  Stored q(p.q, p.dtype), kp(p.kp, p.dtype), vp(p.vp, p.dtype), kn(p.kn, p.dtype),
      vn(p.vn, p.dtype), o(std::vector<float>(T * p.hq * p.d, 0.f), p.dtype);
  lse->assign(T * p.hq, 0.f);
  auto v = [&](Stored& s, std::initializer_list<int64_t> shape) {
    return TensorView::Contiguous(s.data(), p.dtype, shape);
  };
  TensorView lv = TensorView::Contiguous(lse->data(), DType::kFloat32, {T, p.hq});
  RunAttention(plan, v(q, {T, p.hq, p.d}), v(kp, {p.num_blocks, p.bs, p.hkv, p.d}),
               v(vp, {p.num_blocks, p.bs, p.hkv, p.d}), v(kn, {T, p.hkv, p.d}),
               v(vn, {T, p.hkv, p.d}), v(o, {T, p.hq, p.d}), &lv,
               static_cast<float>(1.0 / std::sqrt(double(p.d))), pool, kernels);
  out->resize(T * p.hq * p.d);
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] = o.at(i, p.dtype);
}

// Dense reference in double: every query row against the prefix + its visible new tokens.
void Reference(const Problem& p, std::vector<double>* out, std::vector<double>* lse) {
  const int64_t T = p.T(), G = p.hq / p.hkv, D = p.d;
  out->assign(T * p.hq * D, 0.0);
  lse->assign(T * p.hq, 0.0);
  const double scale = 1.0 / std::sqrt(double(D));
  for (size_t b = 0; b < p.reqs.size(); ++b) {
    const Req& r = p.reqs[b];
    for (int64_t i = 0; i < r.q_len; ++i) {
      const int64_t row = p.q_indptr[b] + i;
      std::vector<const float*> keys_rows;  // (k, v) pointers per head 0
      std::vector<int64_t> slots, news;
      for (int64_t t = 0; t < r.prefix; ++t) {
        slots.push_back(int64_t(p.tables[b * p.max_blocks + t / p.bs]) * p.bs + t % p.bs);
      }
      for (int64_t j = 0; j <= i; ++j) {
        bool vis = r.parents.empty() ? true : false;
        if (!r.parents.empty()) {
          for (int64_t a = i; a >= 0; a = r.parents[a]) vis |= a == j;
        }
        if (vis) news.push_back(p.q_indptr[b] + j);
      }
      for (int64_t h = 0; h < p.hq; ++h) {
        const float* qv = &p.q[(row * p.hq + h) * D];
        const int64_t kh = h / G;
        std::vector<double> s;
        std::vector<const float*> vs;
        auto add = [&](const float* k, const float* v) {
          double acc = 0;
          for (int64_t x = 0; x < D; ++x) acc += double(qv[x]) * k[x];
          s.push_back(acc * scale);
          vs.push_back(v);
        };
        for (int64_t sl : slots) add(&p.kp[(sl * p.hkv + kh) * D], &p.vp[(sl * p.hkv + kh) * D]);
        for (int64_t n : news) add(&p.kn[(n * p.hkv + kh) * D], &p.vn[(n * p.hkv + kh) * D]);
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (size_t k = 0; k < s.size(); ++k) {
          for (int64_t x = 0; x < D; ++x) (*out)[(row * p.hq + h) * D + x] += s[k] / sum * vs[k][x];
        }
        (*lse)[row * p.hq + h] = mx + std::log(sum);
      }
    }
  }
}

void ExpectMatchesReference(const Problem& p, const AttentionPlanOptions& opt = {},
                            const LinearKernels* kernels = nullptr) {
  std::vector<float> out, lse;
  RunKernel(p, Plan(p, opt), &out, &lse, nullptr, kernels);
  std::vector<double> ref, ref_lse;
  Reference(p, &ref, &ref_lse);
  const double tol = p.dtype == DType::kFloat32 ? 1e-5 : 2e-2;
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], ref[i], tol) << "out element " << i;
  }
  for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 1e-4) << "lse " << i;
}

std::vector<int32_t> RandomTree(int n, std::mt19937& rng) {
  std::vector<int32_t> parents(n, -1);
  for (int i = 1; i < n; ++i) parents[i] = std::uniform_int_distribution<int>(0, i - 1)(rng);
  return parents;
}

TEST(Attention, DecodeTokensOverPermutedPages) {
  std::vector<Req> reqs = {{0, 1, {}}, {1, 1, {}}, {17, 1, {}}, {300, 1, {}}};
  ExpectMatchesReference(MakeProblem(reqs, 9, 3, 64, 16, DType::kFloat32, 1));
}

TEST(Attention, TreeWithBlockSizeOne) {
  std::mt19937 rng(2);
  std::vector<Req> reqs = {{45, 13, RandomTree(13, rng)}, {0, 70, RandomTree(70, rng)}};
  ExpectMatchesReference(MakeProblem(reqs, 8, 2, 80, 1, DType::kFloat32, 3));
}

TEST(Attention, CausalPrefillChunkAndMixedBatch) {
  std::mt19937 rng(4);
  std::vector<Req> reqs = {{0, 130, {}}, {33, 1, {}}, {70, 9, RandomTree(9, rng)}, {5, 0, {}}};
  ExpectMatchesReference(MakeProblem(reqs, 3, 3, 96, 16, DType::kFloat32, 5));
}

TEST(Attention, ChainTreeEqualsCausalChunk) {
  Problem chain = MakeProblem({{50, 6, {-1, 0, 1, 2, 3, 4}}}, 4, 1, 64, 16, DType::kFloat32, 6);
  Problem causal = chain;
  causal.reqs[0].parents.clear();
  causal.parents.clear();
  causal.tree_indptr = {0, 0};
  std::vector<float> o1, l1, o2, l2;
  RunKernel(chain, Plan(chain), &o1, &l1);
  RunKernel(causal, Plan(causal), &o2, &l2);
  for (size_t i = 0; i < o1.size(); ++i) ASSERT_NEAR(o1[i], o2[i], 1e-6);
}

TEST(Attention, SplitKVMatchesReferenceAndUnsplit) {
  std::mt19937 rng(7);
  std::vector<Req> reqs = {{3000, 16, RandomTree(16, rng)}, {1999, 1, {}}};
  Problem p = MakeProblem(reqs, 12, 4, 128, 16, DType::kFloat32, 8);
  AttentionPlanOptions split;
  split.min_kv_chunk = 64;
  split.num_threads = 16;
  AttentionPlan plan = Plan(p, split);
  EXPECT_GT(plan.merges().size(), 0u);
  ExpectMatchesReference(p, split);
  AttentionPlanOptions whole;
  whole.min_kv_chunk = 1 << 20;
  EXPECT_EQ(Plan(p, whole).merges().size(), 0u);
  ExpectMatchesReference(p, whole);
}

TEST(Attention, HalfStorage) {
  std::mt19937 rng(9);
  std::vector<Req> reqs = {{100, 20, RandomTree(20, rng)}, {37, 1, {}}};
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    ExpectMatchesReference(MakeProblem(reqs, 4, 4, 256, 16, dt, 10));
    ExpectMatchesReference(MakeProblem(reqs, 6, 2, 128, 1, dt, 11));
  }
}

// Every build of the kernel, each chosen through its own LinearKernels (a model's kernel set;
// nothing process-wide): a build this CPU lacks is a visible skip, or a failure where
// PYSPEC_EXPECT_ISAS names it.
class AttentionIsaTest : public IsaParamTest {};

TEST_P(AttentionIsaTest, MatchesTheReference) {
  EXPECT_EQ(detail::AttentionIsa(k()), GetParam());
  std::mt19937 rng(12);
  std::vector<Req> reqs = {{700, 30, RandomTree(30, rng)}, {20, 3, {}}, {5, 1, {}}};
  // Group sizes 3 and 4 and head dims 64/80/128 exercise narrow (<= 8) and wide query tiles.
  ExpectMatchesReference(MakeProblem(reqs, 9, 3, 64, 16, DType::kFloat32, 13), {}, k());
  ExpectMatchesReference(MakeProblem(reqs, 8, 2, 80, 1, DType::kFloat32, 16), {}, k());
  ExpectMatchesReference(MakeProblem(reqs, 4, 4, 128, 16, DType::kBFloat16, 17), {}, k());
}

INSTANTIATE_TEST_SUITE_P(Builds, AttentionIsaTest,
                         ::testing::Values("generic", "avx2", "avx512"));

TEST(Attention, AutoKernelsRunTheWidestBuild) {
  // AMX kernels (an AVX-512 CPU) run the AVX-512 attention build: it has no AMX one.
  const std::string best = detail::AttentionIsa();
  EXPECT_EQ(detail::AttentionIsa(&LinearKernels::Default()), best);
  EXPECT_TRUE(best == "generic" || best == "avx2" || best == "avx512") << best;
}

TEST(Attention, ResultIndependentOfPool) {
  std::mt19937 rng(14);
  Problem p = MakeProblem({{500, 40, RandomTree(40, rng)}}, 4, 2, 64, 16, DType::kFloat32, 15);
  AttentionPlan plan = Plan(p);
  std::vector<float> o1, l1, o2, l2;
  ThreadPool one(1);
  RunKernel(p, plan, &o1, &l1, &one);
  RunKernel(p, plan, &o2, &l2);
  EXPECT_EQ(o1, o2);
  EXPECT_EQ(l1, l2);
}

TEST(Attention, PlanRejectsBadInput) {
  std::mt19937 rng(16);
  Problem good = MakeProblem({{20, 3, {-1, 0, 0}}, {5, 2, {}}}, 2, 1, 64, 4, DType::kFloat32, 17);
  EXPECT_NO_THROW(Plan(good));
  auto expect_error = [&](Problem p, const std::string& what) {
    try {
      Plan(p);
      ADD_FAILURE() << "no error for " << what;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  Problem p = good;
  p.tables[0] = static_cast<int32_t>(p.num_blocks);
  expect_error(p, "block_tables[0, 0]");
  p = good;
  p.tables[1] = -1;
  expect_error(p, "block_tables[0, 1]");
  p = good;
  p.parents[2] = 2;
  expect_error(p, "tree_parents");
  p = good;
  p.parents[0] = 0;
  expect_error(p, "tree_parents");
  p = good;
  p.tree_indptr = {0, 2, 3};
  p.parents = {-1, 0, -1};
  expect_error(p, "tree_indptr");
  p = good;
  p.prefix[1] = -1;
  expect_error(p, "prefix_lens[1]");
  p = good;
  p.prefix[1] = 1000;
  expect_error(p, "block_tables");
  p = good;
  p.q_indptr = {0, 3, 2};
  expect_error(p, "q_indptr");
  p = good;
  p.q_indptr[0] = 1;
  expect_error(p, "q_indptr");
  AttentionPlanOptions bad_heads;
  bad_heads.num_q_heads = 3;
  bad_heads.num_kv_heads = 2;
  EXPECT_THROW(Plan(good, bad_heads), ValueError);
}

TEST(Attention, RunRejectsBadInput) {
  Problem p = MakeProblem({{20, 3, {}}}, 4, 2, 64, 4, DType::kFloat32, 18);
  AttentionPlan plan = Plan(p);
  const int64_t T = p.T();
  std::vector<float> q(p.q), kp(p.kp), vp(p.vp), kn(p.kn), vn(p.vn), out(T * 4 * 64), lse(T * 4);
  auto f = [](std::vector<float>& v, std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(v.data(), DType::kFloat32, s);
  };
  TensorView qv = f(q, {T, 4, 64}), kpv = f(kp, {p.num_blocks, 4, 2, 64});
  TensorView vpv = f(vp, {p.num_blocks, 4, 2, 64});
  TensorView knv = f(kn, {T, 2, 64}), vnv = f(vn, {T, 2, 64});
  TensorView ov = f(out, {T, 4, 64}), lv = f(lse, {T, 4});
  EXPECT_NO_THROW(RunAttention(plan, qv, kpv, vpv, knv, vnv, ov, &lv, 0.125f));
  auto expect_error = [&](const std::string& what, TensorView a, TensorView b, TensorView c,
                          TensorView d, TensorView e, TensorView o, const TensorView* l) {
    try {
      RunAttention(plan, a, b, c, d, e, o, l, 0.125f);
      ADD_FAILURE() << "no error for " << what;
    } catch (const ValueError& err) {
      EXPECT_NE(std::string(err.what()).find(what), std::string::npos) << err.what();
    }
  };
  expect_error("'q'", f(q, {T, 3, 64}), kpv, vpv, knv, vnv, ov, &lv);
  expect_error("'k_pages'", qv, f(kp, {p.num_blocks - 1, 4, 2, 64}), vpv, knv, vnv, ov, &lv);
  expect_error("'v_new'", qv, kpv, vpv, knv, f(vn, {T, 1, 128}), ov, &lv);
  expect_error("'lse'", qv, kpv, vpv, knv, vnv, ov, &qv);
  TensorView half_k = kpv;
  half_k.dtype = DType::kBFloat16;
  expect_error("'v_pages'", qv, half_k, vpv, knv, vnv, ov, &lv);
  TensorView strided = qv;
  strided.strides[0] = 1;
  expect_error("'q'", strided, kpv, vpv, knv, vnv, ov, &lv);
  TensorView cuda = qv;
  cuda.device.type = DeviceType::kCUDA;
  expect_error("'q'", cuda, kpv, vpv, knv, vnv, ov, &lv);
}

// ---- the GPU work partition (cuda/attention_plan.h), emulated on the host --------------------
//
// Runs every item of gpu_plan::Build for every KV head with the kernels' per-item rules (query
// vector m = local row m / G, head h * G + m % G; keys = the item's prefix chunk, then, for the
// request's last chunk, the new tokens up to the tile's last row under SeesNewToken; pages through
// the plan's page list; chunk results merged by log-sum-exp) in scalar double arithmetic, and
// compares with the reference. This tests the host-side logic of the CUDA path without a GPU.
void EmulateGpuPartition(const Problem& p, int64_t num_sms, std::vector<double>* out,
                         std::vector<double>* lse, gpu_plan::Partition* part_out) {
  const AttentionPlan plan = Plan(p);
  const int64_t G = p.hq / p.hkv, D = p.d, T = p.T();
  const gpu_plan::Partition part =
      gpu_plan::Build(plan.q_indptr(), plan.prefix_lens(), G, p.hkv, num_sms, 2);
  out->assign(T * p.hq * D, std::nan(""));
  lse->assign(T * p.hq, std::nan(""));
  std::vector<double> po(part.num_partial_rows * p.hq * D, std::nan(""));
  std::vector<double> pl(part.num_partial_rows * p.hq, std::nan(""));
  const double scale = 1.0 / std::sqrt(double(D));
  for (const gpu_plan::Item& it : part.items) {
    const int64_t b = it.request, q_first = plan.q_indptr()[b], prefix = plan.prefix_lens()[b];
    const bool is_tree = plan.tree_flags()[b] != 0;
    const int64_t new_keys = it.with_new ? it.q_end - q_first : 0;
    for (int64_t h = 0; h < p.hkv; ++h) {
      for (int64_t m = 0; m < (it.q_end - it.q_begin) * G; ++m) {
        const int64_t local = m / G, head = h * G + m % G, row = it.q_begin + local;
        const int64_t i = row - q_first;
        const float* qv = &p.q[(row * p.hq + head) * D];
        std::vector<double> s;
        std::vector<const float*> vs;
        auto add = [&](const float* k, const float* v) {
          double acc = 0;
          for (int64_t x = 0; x < D; ++x) acc += double(qv[x]) * k[x];
          s.push_back(acc * scale);
          vs.push_back(v);
        };
        for (int64_t key = it.kv_begin; key < it.kv_end; ++key) {
          const int32_t page = plan.pages()[plan.page_indptr()[b] + key / p.bs];
          const int64_t slot = int64_t(page) * p.bs + key % p.bs;
          add(&p.kp[(slot * p.hkv + h) * D], &p.vp[(slot * p.hkv + h) * D]);
        }
        const uint64_t* mask = is_tree ? plan.masks().data() + (q_first + i) * 4 : nullptr;
        for (int64_t t = 0; t < new_keys; ++t) {
          if (!gpu_plan::SeesNewToken<4>(is_tree, mask, i, t)) continue;
          add(&p.kn[((q_first + t) * p.hkv + h) * D], &p.vn[((q_first + t) * p.hkv + h) * D]);
        }
        ASSERT_FALSE(s.empty()) << "an item with no visible key";
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        double* o = it.partial_row < 0 ? &(*out)[(row * p.hq + head) * D]
                                       : &po[((it.partial_row + local) * p.hq + head) * D];
        for (int64_t x = 0; x < D; ++x) o[x] = 0.0;
        for (size_t k = 0; k < s.size(); ++k) {
          for (int64_t x = 0; x < D; ++x) o[x] += s[k] / sum * vs[k][x];
        }
        (it.partial_row < 0 ? (*lse)[row * p.hq + head]
                            : pl[(it.partial_row + local) * p.hq + head]) = mx + std::log(sum);
      }
    }
  }
  for (const gpu_plan::Merge& mg : part.merges) {
    const int64_t rows = mg.q_end - mg.q_begin;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t head = 0; head < p.hq; ++head) {
        double mx = -INFINITY;
        for (int64_t c = 0; c < mg.num_chunks; ++c) {
          mx = std::max(mx, pl[(mg.partial_row + c * rows + r) * p.hq + head]);
        }
        double wsum = 0;
        std::vector<double> acc(D, 0.0);
        for (int64_t c = 0; c < mg.num_chunks; ++c) {
          const int64_t prow = mg.partial_row + c * rows + r;
          const double w = std::exp(pl[prow * p.hq + head] - mx);
          wsum += w;
          for (int64_t x = 0; x < D; ++x) acc[x] += w * po[(prow * p.hq + head) * D + x];
        }
        const int64_t row = mg.q_begin + r;
        for (int64_t x = 0; x < D; ++x) (*out)[(row * p.hq + head) * D + x] = acc[x] / wsum;
        (*lse)[row * p.hq + head] = mx + std::log(wsum);
      }
    }
  }
  if (part_out != nullptr) *part_out = part;
}

TEST(GpuPartition, EmulatedItemsMatchTheReference) {
  std::mt19937 rng(11);
  // (sms, hq, hkv): few SMs force no split; many SMs force split-KV on the long prefixes.
  const int64_t configs[][3] = {{1, 4, 4}, {132, 8, 2}, {132, 9, 3}, {64, 32, 8}, {132, 4, 1},
                                {132, 128, 1}};
  int splits_seen = 0;
  for (const auto& cfg : configs) {
    std::vector<Req> reqs;
    for (int b = 0; b < 9; ++b) {
      const int64_t prefix = std::vector<int64_t>{0, 1, 63, 64, 65, 300, 1000, 2049, 17}[b];
      if (b % 3 == 0) {
        reqs.push_back({prefix, 1 + b * 5, {}});
      } else {
        const int n = std::vector<int>{1, 2, 16, 64, 65, 100, 256, 7, 33}[b];
        reqs.push_back({prefix, n, RandomTree(n, rng)});
      }
    }
    const Problem p = MakeProblem(reqs, cfg[1], cfg[2], 16, 16, DType::kFloat32,
                                  static_cast<uint32_t>(cfg[0] + cfg[1]));
    std::vector<double> out, lse, ref, ref_lse;
    gpu_plan::Partition part;
    EmulateGpuPartition(p, cfg[0], &out, &lse, &part);
    splits_seen += !part.merges.empty();
    // Every query row is covered exactly once per head (a second write or a gap shows as NaN or
    // a mismatch) and each tile holds at most 64 query vectors (or one row when G > 64).
    for (const gpu_plan::Item& it : part.items) {
      ASSERT_LE((it.q_end - it.q_begin) * (cfg[1] / cfg[2]),
                std::max<int64_t>(gpu_plan::kTileVectors, cfg[1] / cfg[2]));
      ASSERT_TRUE(part.kv_chunk == 0 || it.kv_begin % gpu_plan::kTileKeys == 0);
    }
    Reference(p, &ref, &ref_lse);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-9) << "out " << i;
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 1e-9) << "lse " << i;
  }
  EXPECT_GE(splits_seen, 3) << "the configurations should exercise split-KV";
}

TEST(GpuPartition, SplitsOnlyWhenTheDeviceWouldBeUnderFilled) {
  const std::vector<int64_t> qi = {0, 1}, decode_8k = {8192};
  const gpu_plan::Partition one = gpu_plan::Build(qi, decode_8k, 4, 8, 132, 2);
  ASSERT_GT(one.merges.size(), 0u);
  // 8 KV heads x 1 tile want 66 chunks each for two waves of 2 x 132 blocks; the 256-key minimum
  // chunk caps that at 32.
  EXPECT_EQ(one.kv_chunk, 256);
  EXPECT_EQ(one.items.size(), 32u);
  EXPECT_EQ(one.merges[0].num_chunks, 32);
  std::vector<int64_t> qi64(257), prefix64(256, 8192);
  for (int i = 0; i <= 256; ++i) qi64[i] = i * 16;  // 256 trees of 16 nodes: plenty of blocks
  const gpu_plan::Partition many = gpu_plan::Build(qi64, prefix64, 4, 8, 132, 2);
  EXPECT_EQ(many.merges.size(), 0u);
  EXPECT_EQ(many.kv_chunk, 0);
}

TEST(Half, ConversionsRoundTripAndRound) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half::HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half::HalfToFloat(half::FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(half::FloatToHalf(f), h) << h;
    ASSERT_EQ(half::FloatToBF16(half::BF16ToFloat(static_cast<uint16_t>(h))), h) << h;
  }
  EXPECT_EQ(half::HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(half::HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(half::FloatToHalf(65520.0f), 0x7c00);                       // rounds to inf
  EXPECT_EQ(half::FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);   // tie to even
  EXPECT_EQ(half::FloatToBF16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);    // tie to even
  EXPECT_EQ(half::FloatToBF16(1.0f + std::ldexp(3.0f, -8)), 0x3f82);    // tie to even (up)
}

}  // namespace
}  // namespace pyspec
