#include "pyspec/adaptive.h"

#include <algorithm>
#include <cmath>

#include "pyspec/check.h"

namespace pyspec {

void StepCostModel::ObserveStep(int64_t batch, int64_t tokens, double seconds) {
  PYSPEC_CHECK(batch >= 0 && tokens >= batch && std::isfinite(seconds) && seconds >= 0.0,
               "observe_step_time: batch must be >= 0, tokens >= batch and seconds finite and "
               ">= 0; got batch ", batch, ", tokens ", tokens, ", seconds ", seconds);
  if (batch == 0) return;
  undrafted_steps_ = tokens <= batch ? undrafted_steps_ + 1 : 0;
  drafted_steps_ = tokens > batch ? drafted_steps_ + 1 : 0;
  const double x = static_cast<double>(tokens), y = seconds;
  double* f = fit_;
  f[0] = kStepFitDecay * f[0] + 1;
  f[1] = kStepFitDecay * f[1] + x;
  f[2] = kStepFitDecay * f[2] + y;
  f[3] = kStepFitDecay * f[3] + x * x;
  f[4] = kStepFitDecay * f[4] + x * y;
  last_batch_ = batch;
}

void StepCostModel::ObserveDraft(int32_t group, double seconds, int64_t levels) {
  PYSPEC_CHECK(group >= 0 && std::isfinite(seconds) && seconds >= 0.0 && levels >= 0,
               "observe_draft_time: group and levels must be >= 0 and seconds finite and >= 0; "
               "got group ", group, ", seconds ", seconds, ", levels ", levels);
  auto it = std::find_if(draft_time_.begin(), draft_time_.end(),
                         [group](const DraftTime& d) { return d.group == group; });
  if (it == draft_time_.end()) it = draft_time_.insert(draft_time_.end(), {group, 0.0, 0.0});
  it->seconds = kDraftTimeDecay * it->seconds + seconds;
  it->levels = kDraftTimeDecay * it->levels + static_cast<double>(levels);
}

void StepCostModel::ObserveTree(int64_t nodes, int64_t depth) {
  if (nodes <= 0 || depth <= 0) return;
  const double per_level = static_cast<double>(nodes) / static_cast<double>(depth);
  nodes_per_level_ = kNodesPerLevelDecay * nodes_per_level_ + kNodesPerLevelWeight * per_level;
}

void StepCostModel::OnCalibration() {
  drafted_steps_ = 0;
  ++stats_.calibration_steps;
}

CostModelUpdate StepCostModel::Refit(int64_t memory_bound_tokens) {
  CostModelUpdate u;
  const int64_t b = last_batch_;
  if (memory_bound_tokens > 0 && memory_bound_tokens <= b && undrafted_steps_ >= probe_interval_) {
    // Budget probe. Lifted to twice the batch, not away: unlimited, every request would verify a
    // full tree (8 requests x 16 nodes = 136 tokens), steps that cost far more than the plain
    // steps they replace, and the fit would learn their cost instead of the next few tokens'.
    u.memory_bound_tokens = std::max(2 * b, b + 8);
    undrafted_steps_ = 0;
    probe_interval_ = std::min(2 * probe_interval_, kBudgetProbeMax);
    ++stats_.budget_probes;
    return u;
  }
  const double n = fit_[0], sx = fit_[1], sy = fit_[2], sxx = fit_[3], sxy = fit_[4];
  if (n < 4) return u;
  const double var = sxx - sx * sx / n;
  if (var <= 1e-9 * std::max(n, 1.0)) return u;  // no spread in step sizes yet
  const double slope = std::max((sxy - sx * sy / n) / var, 0.0);
  const double base = std::max(sy / n - slope * sx / n, 1e-6);
  const double plain = base + slope * static_cast<double>(b);  // one plain step of the batch
  double verify = slope / plain * nodes_per_level_;             // per draft level
  double sec = 0.0, levels = 0.0;
  for (const DraftTime& d : draft_time_) {
    sec += d.seconds;
    levels += d.levels;
  }
  double draft = levels > 0 ? (sec / levels) / plain : 0.0;
  // In a batch, b + a - 1 tokens for (1 + c * g) of a plain step's time gain over plain only when
  // a - 1 > b * c * g: each request's draft length is chosen with its costs times the batch.
  draft = std::min(std::max(draft * static_cast<double>(b), 0.0), kMaxCostRatio);
  verify = std::min(std::max(verify * static_cast<double>(b), 0.0), kMaxCostRatio);
  stats_.draft_cost = draft;
  stats_.verify_cost = verify;
  u.set_costs = true;
  u.draft_cost = draft;
  u.verify_cost = verify;
  if (slope > 0) {
    // A step stays memory-bound while its tokens cost less than its fixed part. Rounded half to
    // even (the default floating-point rounding mode).
    const double tokens = std::min(std::nearbyint(base / slope), kMaxMemoryBoundTokens);
    const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(tokens));
    u.memory_bound_tokens = limit;
    stats_.spec_free_tokens = limit - b;
  }
  return u;
}

}  // namespace pyspec
