// Adaptive speculation's measurements (pyspec/adaptive.h) and how the scheduler applies them:
// the step-time fit, budget probes, calibration steps, drafter-switching evidence and drafters
// that fail.
#include "pyspec/adaptive.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/scheduler.h"

namespace pyspec {
namespace {

// t = base + per_token * tokens for each of `tokens`, at `batch`.
void Observe(StepCostModel& m, int64_t batch, std::vector<int64_t> tokens, double base,
             double per_token) {
  for (int64_t t : tokens) m.ObserveStep(batch, t, base + per_token * static_cast<double>(t));
}

TEST(StepCostModel, FitsBaseAndSlope) {
  StepCostModel m;
  EXPECT_FALSE(m.Refit(0).set_costs);  // no data
  Observe(m, 4, {4, 8, 12, 16, 20, 24, 28, 32}, 0.010, 0.001);
  const CostModelUpdate u = m.Refit(0);
  ASSERT_TRUE(u.set_costs);
  ASSERT_TRUE(u.memory_bound_tokens.has_value());
  EXPECT_EQ(*u.memory_bound_tokens, 10);  // base / slope
  EXPECT_EQ(*m.stats().spec_free_tokens, 6);
  // verify: slope / plain step of the batch, times the batch (nodes per level 1)
  EXPECT_NEAR(u.verify_cost, 4 * 0.001 / (0.010 + 0.004), 1e-9);
  EXPECT_EQ(u.draft_cost, 0.0);  // no draft timings
}

TEST(StepCostModel, DraftCostCountsTheBatch) {
  for (int64_t batch : {1, 4}) {
    StepCostModel m;
    Observe(m, batch, {4, 8, 12, 16, 20, 24, 28, 32}, 0.010, 0.001);
    m.ObserveDraft(0, 0.014, 10);  // 1.4 ms per level
    const CostModelUpdate u = m.Refit(0);
    const double plain = 0.010 + 0.001 * static_cast<double>(batch);
    EXPECT_NEAR(u.draft_cost, static_cast<double>(batch) * 0.0014 / plain, 1e-9) << batch;
  }
}

TEST(StepCostModel, NeedsSpreadInStepSizes) {
  StepCostModel m;
  Observe(m, 2, {2, 2, 2, 2, 2, 2}, 0.010, 0.001);  // plain steps only
  EXPECT_FALSE(m.Refit(0).set_costs);
  StepCostModel few;
  Observe(few, 2, {2, 4, 6}, 0.010, 0.001);  // fewer than 4 steps
  EXPECT_FALSE(few.Refit(0).set_costs);
}

TEST(StepCostModel, BudgetProbesDoubleUpToTheMaximum) {
  StepCostModel m;
  Observe(m, 4, {4, 8, 12, 16, 20}, 0.010, 0.005);  // limit 2, below the batch
  ASSERT_EQ(*m.Refit(0).memory_bound_tokens, 2);
  std::vector<int64_t> waits;
  for (int probe = 1; probe <= 6; ++probe) {
    Observe(m, 4, {4, 8, 12, 16, 20}, 0.010, 0.005);
    int64_t limit = *m.Refit(0).memory_bound_tokens;
    ASSERT_LE(limit, 4);
    int64_t n = 0;
    while (m.stats().budget_probes < probe) {
      m.ObserveStep(4, 4, 0.030);
      const CostModelUpdate u = m.Refit(limit);
      if (u.memory_bound_tokens) limit = *u.memory_bound_tokens;
      ++n;
      ASSERT_LT(n, 1000);
    }
    EXPECT_EQ(limit, 12);  // twice the batch, at least 8 more tokens
    waits.push_back(n);
  }
  // (the first wait counts the five drafted observations' reset: 8 undrafted steps)
  EXPECT_EQ(waits, (std::vector<int64_t>{8, 16, 32, 64, 64, 64}));
}

TEST(StepCostModel, CalibrationIsDueAfterDraftedSteps) {
  StepCostModel m;
  for (int64_t i = 0; i < kCalibrationSteps - 1; ++i) m.ObserveStep(1, 3, 0.01);
  EXPECT_FALSE(m.CalibrationDue());
  m.ObserveStep(1, 3, 0.01);
  EXPECT_TRUE(m.CalibrationDue());
  m.OnCalibration();
  EXPECT_FALSE(m.CalibrationDue());
  EXPECT_EQ(m.stats().calibration_steps, 1);
  for (int64_t i = 0; i < kCalibrationSteps - 1; ++i) m.ObserveStep(1, 3, 0.01);
  m.ObserveStep(1, 1, 0.01);  // a plain step resets the run
  EXPECT_FALSE(m.CalibrationDue());
}

TEST(StepCostModel, NodesPerLevelAverages) {
  StepCostModel m;
  EXPECT_EQ(m.nodes_per_level(), 1.0);
  m.ObserveTree(6, 2);
  EXPECT_DOUBLE_EQ(m.nodes_per_level(), 0.95 + 0.05 * 3.0);
  m.ObserveTree(0, 0);  // nothing drafted: unchanged
  EXPECT_DOUBLE_EQ(m.nodes_per_level(), 0.95 + 0.05 * 3.0);
}

TEST(StepCostModel, RejectsBadMeasurements) {
  StepCostModel m;
  EXPECT_THROW(m.ObserveStep(2, 1, 0.01), ValueError);
  EXPECT_THROW(m.ObserveStep(1, 1, NAN), ValueError);
  EXPECT_THROW(m.ObserveDraft(-1, 0.01, 1), ValueError);
  EXPECT_THROW(m.ObserveDraft(0, -1.0, 1), ValueError);
}

// ---- the scheduler ----

SchedulerConfig Adaptive() {
  SchedulerConfig c;
  c.max_draft_tokens = 2;
  c.initial_draft_tokens = 2;
  c.measure_costs = true;
  return c;
}

// Steps a single speculative request with every draft accepted; returns the budgets it got.
std::vector<int64_t> RunDecodeSteps(Scheduler& s, int64_t id, int64_t steps) {
  std::vector<int64_t> budgets;
  for (int64_t i = 0; i < steps; ++i) {
    ScheduleOutput out = s.Step();
    StepResult res;
    bool prefill = false;
    for (int64_t j = 0; j < out.size(); ++j) {
      if (out.kinds[j] == StepKind::kPrefill) {
        res.AddPrefill(out.ids[j], out.token_indptr[j + 1] - out.token_indptr[j]);
        prefill = true;
        continue;
      }
      const int64_t b = out.draft_budget[j];
      if (out.ids[j] == id) budgets.push_back(b);
        res.AddDecode(out.ids[j], std::vector<int32_t>(b + 1, 7), b, b);
    }
    // The engine reports the time of every decode-only step.
    if (!prefill) s.ObserveStepTime(out.size(), out.num_budgeted_tokens(), 0.01);
    s.Update(res);
  }
  return budgets;
}

TEST(SchedulerAdaptive, CalibrationStepsDecodePlainly) {
  Scheduler s(Adaptive(), 64, 16);
  SamplingParams p;
  p.max_tokens = 1000;
  s.AddRequest(1, {1, 2, 3}, p);
  std::vector<int64_t> budgets = RunDecodeSteps(s, 1, 3 * (kCalibrationSteps + 1) + 1);
  // (the first step is the prefill)
  std::vector<size_t> plain_at;
  for (size_t i = 0; i < budgets.size(); ++i) {
    if (budgets[i] == 0) plain_at.push_back(i);
  }
  ASSERT_EQ(plain_at.size(), 3u);
  for (size_t k = 0; k < plain_at.size(); ++k) {
    EXPECT_EQ(plain_at[k], (k + 1) * (kCalibrationSteps + 1) - 1);
  }
  EXPECT_EQ(s.cost_model_stats().calibration_steps, 3);
  EXPECT_EQ(s.GetRequest(1).state(), RequestState::kRunningSpeculative);
  s.CheckInvariants();
}

TEST(SchedulerAdaptive, NoCalibrationWithoutAdaptive) {
  SchedulerConfig c = Adaptive();
  c.measure_costs = false;
  Scheduler s(c, 64, 16);
  SamplingParams p;
  p.max_tokens = 1000;
  s.AddRequest(1, {1, 2, 3}, p);
  for (int64_t b : RunDecodeSteps(s, 1, 2 * kCalibrationSteps + 4)) EXPECT_GT(b, 0);
  EXPECT_DOUBLE_EQ(s.cost_model_stats().verify_cost, StepCostModel().stats().verify_cost);
}

TEST(SchedulerAdaptive, RefitsEveryIntervalFromReportedTimes) {
  Scheduler s(Adaptive(), 64, 16);
  SamplingParams p;
  p.max_tokens = 1000;
  s.AddRequest(1, {1, 2, 3}, p);
  s.AddRequest(2, {4, 5, 6}, p);
  for (int i = 0; i < 8; ++i) s.ObserveStepTime(2, 2 + 2 * i, 0.010 + 0.002 * (2 + 2 * i));
  EXPECT_EQ(s.config().memory_bound_tokens, 0);
  RunDecodeSteps(s, 1, kRefitInterval);  // the refit comes with the kRefitInterval-th update
  EXPECT_GT(s.config().memory_bound_tokens, 0);
  EXPECT_GT(s.config().verify_cost, 0.0);
}

TEST(SchedulerAdaptive, ResetPolicyForgetsWhatWasLearned) {
  SchedulerConfig c = Adaptive();
  c.verify_cost = 0.03;
  Scheduler s(c, 64, 16);
  SamplingParams p;
  p.max_tokens = 1000;
  s.AddRequest(1, {1, 2, 3}, p);
  s.AddRequest(2, {4, 5, 6}, p);
  for (int i = 0; i < 8; ++i) s.ObserveStepTime(2, 2 + 2 * i, 0.010 + 0.002 * (2 + 2 * i));
  RunDecodeSteps(s, 1, kRefitInterval);
  s.SetSpecBudget(5, 3);
  ASSERT_GT(s.config().memory_bound_tokens, 0);  // (what the refit measured)
  ASSERT_NE(s.config().verify_cost, 0.03);
  ASSERT_GE(s.deployment_acceptance_ewma(), 0.0);
  ASSERT_GT(s.DeploymentEvidence(0).second, 0.0);
  ASSERT_TRUE(s.cost_model_stats().spec_free_tokens.has_value());
  s.ResetPolicy();
  EXPECT_FALSE(s.cost_model_stats().spec_free_tokens.has_value());
  EXPECT_EQ(s.config().memory_bound_tokens, 0);
  EXPECT_DOUBLE_EQ(s.config().verify_cost, 0.03);
  EXPECT_EQ(s.config().spec_token_budget, c.spec_token_budget);
  EXPECT_EQ(s.config().spec_disable_batch_size, c.spec_disable_batch_size);
  EXPECT_LT(s.deployment_acceptance_ewma(), 0.0);
  EXPECT_EQ(s.DeploymentEvidence(0).second, 0.0);
  EXPECT_DOUBLE_EQ(s.cost_model_stats().verify_cost, StepCostModel().stats().verify_cost);
  // The requests in flight go on speculating.
  for (int64_t b : RunDecodeSteps(s, 1, 3)) EXPECT_GE(b, 0);
  EXPECT_EQ(s.GetRequest(1).state(), RequestState::kRunningSpeculative);
  s.CheckInvariants();
}

// A scheduler (config `c`, max_draft_tokens = initial_draft_tokens = `draft`) holding request 1
// with its prompt computed: it decodes from the next step.
std::unique_ptr<Scheduler> OneRunning(SchedulerConfig c, int64_t draft, int64_t max_tokens) {
  c.max_draft_tokens = c.initial_draft_tokens = draft;
  auto s = std::make_unique<Scheduler>(c, 64, 16);
  SamplingParams p;
  p.max_tokens = max_tokens;
  s->AddRequest(1, {1, 2, 3}, p);
  s->Step();
  StepResult prefill;
  prefill.AddPrefill(1, 2);
  s->Update(prefill);
  return s;
}

TEST(SchedulerAdaptive, SwitchReasons) {
  std::unique_ptr<Scheduler> sp = OneRunning(SchedulerConfig(), 4, 100);
  Scheduler& s = *sp;
  for (int i = 0; i < kSwitchMinSteps; ++i) {
    ScheduleOutput out = s.Step();
    EXPECT_EQ(s.GetSwitchReason(1, 0.5), SwitchReason::kNone);  // too few steps yet
    StepResult res;
    res.AddDecode(1, {7}, out.draft_budget[0], 0);  // nothing accepted
    s.Update(res);
  }
  EXPECT_EQ(s.GetRequest(1).switch_steps, kSwitchMinSteps);
  EXPECT_EQ(s.GetSwitchReason(1, 0.5), SwitchReason::kLowAcceptance);
  EXPECT_EQ(s.GetSwitchReason(1, 0.0), SwitchReason::kNone);  // switching off
  EXPECT_STREQ(SwitchReasonName(s.GetSwitchReason(1, 0.5)), "low_acceptance");
  ASSERT_TRUE(s.ResetAcceptance(1));  // another drafter: its evidence starts over
  EXPECT_EQ(s.GetSwitchReason(1, 0.5), SwitchReason::kNone);
  EXPECT_LT(s.GetRequest(1).switch_ewma, 0.0);
  EXPECT_THROW(s.GetSwitchReason(99, 0.5), ValueError);
}

TEST(SchedulerAdaptive, FixedDraftLengthHoldsWhateverIsAccepted) {
  for (bool cost_model : {false, true}) {
    SchedulerConfig c;
    c.adapt_draft_length = false;
    c.cost_model = cost_model;
    std::unique_ptr<Scheduler> sp = OneRunning(c, 3, 100);
    Scheduler& s = *sp;
    for (int64_t accepted : {0, 0, 3, 1, 0}) {  // (adapting would shorten, then lengthen)
      ScheduleOutput out = s.Step();
      ASSERT_EQ(out.draft_budget[0], 3);
      StepResult res;
      res.AddDecode(1, std::vector<int32_t>(accepted + 1, 7), 3, accepted);
      s.Update(res);
    }
  }
  // Adapting (the default), two rejected steps shorten the draft.
  std::unique_ptr<Scheduler> sp = OneRunning(SchedulerConfig(), 3, 100);
  for (int i = 0; i < 2; ++i) {
    ScheduleOutput out = sp->Step();
    StepResult res;
    res.AddDecode(1, {7}, out.draft_budget[0], 0);
    sp->Update(res);
  }
  EXPECT_LT(sp->Step().draft_budget[0], 3);
}

TEST(SchedulerAdaptive, DeploymentAcceptanceAverage) {
  SchedulerConfig c;
  c.deployment_ewma_alpha = 0.5;
  std::unique_ptr<Scheduler> sp = OneRunning(c, 2, 100);
  Scheduler& s = *sp;
  EXPECT_LT(s.deployment_acceptance_ewma(), 0.0);
  std::vector<int64_t> accepted = {2, 1, 2};  // (1 of 2 keeps the draft length)
  std::vector<double> want = {1.0, 0.75, 0.875};
  for (size_t i = 0; i < accepted.size(); ++i) {
    ScheduleOutput out = s.Step();
    ASSERT_EQ(out.draft_budget[0], 2);
    StepResult res;
    res.AddDecode(1, std::vector<int32_t>(accepted[i] + 1, 7), 2, accepted[i]);
    s.Update(res);
    EXPECT_DOUBLE_EQ(s.deployment_acceptance_ewma(), want[i]);
  }
}

TEST(SchedulerAdaptive, FailedDrafterIsLeftOutOfCalibration) {
  // Request 1's drafter fails; request 2 drafts on. Calibration steps hold back request 2's drafts
  // only: the failed request keeps its speculative entries (verifying no draft) throughout.
  Scheduler s(Adaptive(), 64, 16);
  SamplingParams p;
  p.max_tokens = 1000;
  s.AddRequest(1, {1, 2, 3}, p);
  s.AddRequest(2, {4, 5, 6}, p);
  EXPECT_THROW(s.MarkDrafterFailed(42), ValueError);
  int64_t held_back = 0;
  for (int64_t step = 0; step < 2 * (kCalibrationSteps + 1) + 1; ++step) {
    ScheduleOutput out = s.Step();
    if (step == 0) EXPECT_TRUE(s.MarkDrafterFailed(1));  // mid-step, while drafting
    StepResult res;
    bool prefill = false;
    int64_t tokens = 0;
    for (int64_t j = 0; j < out.size(); ++j) {
      const int64_t id = out.ids[j];
      if (out.kinds[j] == StepKind::kPrefill) {
        res.AddPrefill(id, out.token_indptr[j + 1] - out.token_indptr[j]);
        prefill = true;
        continue;
      }
      if (id == 1) {
        EXPECT_EQ(out.kinds[j], StepKind::kSpeculative) << "step " << step;
        res.AddDecode(id, {7}, 0, 0);  // its drafter drafts nothing
        tokens += 1;
        continue;
      }
      const int64_t b = out.draft_budget[j];
      if (out.kinds[j] == StepKind::kDecode) ++held_back;
      res.AddDecode(id, std::vector<int32_t>(b + 1, 7), b, b);
      tokens += b + 1;
    }
    if (!prefill) s.ObserveStepTime(out.size(), tokens, 0.01);
    s.Update(res);
  }
  EXPECT_EQ(held_back, 2);
  EXPECT_EQ(s.cost_model_stats().calibration_steps, 2);
  EXPECT_TRUE(s.GetRequest(1).drafter_failed);
  EXPECT_FALSE(s.GetRequest(2).drafter_failed);
  s.CheckInvariants();
  ASSERT_TRUE(s.Abort(2));
  if (s.HasRequest(2)) EXPECT_FALSE(s.MarkDrafterFailed(2));  // finished
}

TEST(SchedulerAdaptive, ConfigChecks) {
  SchedulerConfig c;
  c.deployment_ewma_alpha = 0.0;
  EXPECT_THROW(c.Validate(), ValueError);
}

}  // namespace
}  // namespace pyspec
