// Adaptive speculation's measurements: what a step costs, turned into the cost model's ratios and
// the batch-aware speculation limit (DESIGN section 2, "Scheduler"; Leviathan et al. 2023,
// section 3.4).
//
// The engine that runs the scheduler's steps reports what it measured:
//   * ObserveStep(batch, tokens, seconds): a decode-only step (no prefill chunk) of `batch`
//     requests that ran `tokens` rows (roots plus draft-tree nodes) through the target;
//   * ObserveDraft(group, seconds, levels): drafter `group` drafted `levels` tree levels;
//   * ObserveTree(nodes, depth): a verified tree's nodes and levels (the scheduler does this from
//     StepResult entries).
// From these, Refit() fits the step time as t = base + per_token * tokens (least squares over
// exponentially weighted steps) and derives, per draft level and relative to one plain step of
// the current batch, the drafting cost and the verification cost, both times the batch (in a
// batch, one request's draft rows lengthen every request's step, while its accepted tokens are its
// own), and the memory-bound limit base / per_token: the tokens a step can run before it turns
// compute-bound, which speculation cannot win back.
//
// Two safeguards keep the fit measured:
//   * a budget probe: a fit that put the memory-bound limit at or below the batch stops every
//     draft, and with them the spread of step sizes the fit needs to correct itself; after
//     kBudgetProbeFirst decode steps without a draft (doubling after each probe, up to
//     kBudgetProbeMax) the limit is lifted to twice the batch (at least 8 more tokens) until the
//     next Refit;
//   * calibration steps: after kCalibrationSteps decode-only steps in a row that all drafted, the
//     next decode-only step drafts nothing, so that a drafter whose trees are always the same size
//     (an EAGLE head's) still lets the fit see plain steps; without them the fit's intercept is
//     noise and can price a plain step at 1.5x its time.
//
// Plain data, one instance per scheduler; not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace pyspec {

inline constexpr int64_t kBudgetProbeFirst = 8;
inline constexpr int64_t kBudgetProbeMax = 64;
inline constexpr int64_t kCalibrationSteps = 32;
// Refit() runs once every this many steps of the scheduler (Scheduler::Update).
inline constexpr int64_t kRefitInterval = 4;
// Weight of older steps in the step-time fit, of older draft timings, and of older trees in the
// nodes-per-level average.
inline constexpr double kStepFitDecay = 0.97;
inline constexpr double kDraftTimeDecay = 0.9;
inline constexpr double kNodesPerLevelDecay = 0.95, kNodesPerLevelWeight = 0.05;
// The cost ratios are clamped to [0, kMaxCostRatio] plain steps.
inline constexpr double kMaxCostRatio = 10.0;
// The memory-bound limit a fit may set (a nearly flat fit would otherwise overflow it).
inline constexpr double kMaxMemoryBoundTokens = 1099511627776.0;  // 2^40

// What the cost model measured (exported as metrics).
struct CostModelStats {
  double draft_cost = 0.0;   // per draft level, relative to a plain step, times the batch
  double verify_cost = 0.0;  // per draft level verified, likewise
  // Extra tokens a step can verify before it turns compute-bound (the limit less the batch);
  // unset until the fit has data.
  std::optional<int64_t> spec_free_tokens;
  int64_t budget_probes = 0;      // times the memory-bound limit was lifted to re-measure
  int64_t calibration_steps = 0;  // decode steps run without drafts to measure a plain step
};

// What Refit() decided.
struct CostModelUpdate {
  bool set_costs = false;  // draft_cost / verify_cost are new
  double draft_cost = 0.0;
  double verify_cost = 0.0;
  // The new memory-bound limit (tokens); unset: keep the current one.
  std::optional<int64_t> memory_bound_tokens;
};

class StepCostModel {
 public:
  void ObserveStep(int64_t batch, int64_t tokens, double seconds);
  void ObserveDraft(int32_t group, double seconds, int64_t levels);
  void ObserveTree(int64_t nodes, int64_t depth);

  // Whether the next decode-only step is a calibration step; OnCalibration() when it held a draft
  // back.
  bool CalibrationDue() const { return drafted_steps_ >= kCalibrationSteps; }
  void OnCalibration();

  // The cost model's update from the measurements so far; `memory_bound_tokens` is the limit in
  // use (0: none).
  CostModelUpdate Refit(int64_t memory_bound_tokens);

  const CostModelStats& stats() const { return stats_; }
  double nodes_per_level() const { return nodes_per_level_; }
  int64_t budget_probe_interval() const { return probe_interval_; }

 private:
  struct DraftTime {
    int32_t group;
    double seconds;
    double levels;
  };
  // Exponentially weighted sums for the least-squares fit: n, sum x, sum y, sum x^2, sum xy.
  double fit_[5] = {0.0, 0.0, 0.0, 0.0, 0.0};
  std::vector<DraftTime> draft_time_;  // per drafter group, in the order first seen
  double nodes_per_level_ = 1.0;
  int64_t undrafted_steps_ = 0;  // decode steps in a row that verified no draft token
  int64_t drafted_steps_ = 0;    // decode-only steps in a row that verified a draft token
  int64_t probe_interval_ = kBudgetProbeFirst;  // undrafted steps before the next budget probe
  int64_t last_batch_ = 1;       // requests in the latest decode-only step
  CostModelStats stats_;
};

}  // namespace pyspec
