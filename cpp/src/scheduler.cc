#include "pyspec/scheduler.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>
#include <utility>

#include "pyspec/check.h"

namespace pyspec {

// ---- config / records ------------------------------------------------------------------------

void SchedulerConfig::Validate() const {
  PYSPEC_CHECK(max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1; got ",
               max_num_batched_tokens);
  PYSPEC_CHECK(max_num_seqs >= 1, "max_num_seqs must be >= 1; got ", max_num_seqs);
  PYSPEC_CHECK(max_prefill_chunk >= 0, "max_prefill_chunk must be >= 0; got ", max_prefill_chunk);
  PYSPEC_CHECK(max_draft_tokens >= 0 && max_draft_tokens <= 255,
               "max_draft_tokens must be in [0, 255]; got ", max_draft_tokens);
  PYSPEC_CHECK(initial_draft_tokens >= 0 && initial_draft_tokens <= max_draft_tokens,
               "initial_draft_tokens must be in [0, max_draft_tokens]; got ",
               initial_draft_tokens);
  PYSPEC_CHECK(spec_token_budget >= 0, "spec_token_budget must be >= 0; got ", spec_token_budget);
  PYSPEC_CHECK(spec_disable_batch_size >= 0, "spec_disable_batch_size must be >= 0; got ",
               spec_disable_batch_size);
  PYSPEC_CHECK(ewma_alpha > 0.0 && ewma_alpha <= 1.0, "ewma_alpha must be in (0, 1]; got ",
               ewma_alpha);
  PYSPEC_CHECK(min_acceptance_rate >= 0.0 && min_acceptance_rate <= 1.0,
               "min_acceptance_rate must be in [0, 1]; got ", min_acceptance_rate);
  PYSPEC_CHECK(warmup_steps >= 0, "warmup_steps must be >= 0; got ", warmup_steps);
  PYSPEC_CHECK(probe_interval >= 1 && probe_interval <= (int64_t{1} << 40),
               "probe_interval must be in [1, 2^40]; got ", probe_interval);
  PYSPEC_CHECK(memory_bound_tokens >= 0, "memory_bound_tokens must be >= 0; got ",
               memory_bound_tokens);
  PYSPEC_CHECK(std::isfinite(draft_cost) && draft_cost >= 0.0,
               "draft_cost must be a finite number >= 0; got ", draft_cost);
  PYSPEC_CHECK(std::isfinite(verify_cost) && verify_cost >= 0.0,
               "verify_cost must be a finite number >= 0; got ", verify_cost);
  PYSPEC_CHECK(deployment_ewma_alpha > 0.0 && deployment_ewma_alpha <= 1.0,
               "deployment_ewma_alpha must be in (0, 1]; got ", deployment_ewma_alpha);
}

const char* SwitchReasonName(SwitchReason r) {
  switch (r) {
    case SwitchReason::kNone: return "";
    case SwitchReason::kLowAcceptance: return "low_acceptance";
    case SwitchReason::kCostModel: return "cost_model";
  }
  return "?";
}

const char* StepKindName(StepKind k) {
  switch (k) {
    case StepKind::kPrefill: return "prefill";
    case StepKind::kDecode: return "decode";
    case StepKind::kSpeculative: return "speculative";
  }
  return "?";
}

int64_t ScheduleOutput::num_budgeted_tokens() const {
  int64_t n = num_scheduled_tokens();
  for (int64_t b : draft_budget) n += b;
  return n;
}

std::vector<int32_t> ScheduleOutput::TokensOf(int64_t i) const {
  PYSPEC_CHECK(i >= 0 && i < size(), "entry ", i, " out of range [0, ", size(), ")");
  return {tokens.begin() + token_indptr[i], tokens.begin() + token_indptr[i + 1]};
}
std::vector<int32_t> ScheduleOutput::BlockTableOf(int64_t i) const {
  PYSPEC_CHECK(i >= 0 && i < size(), "entry ", i, " out of range [0, ", size(), ")");
  return {block_tables.begin() + block_indptr[i], block_tables.begin() + block_indptr[i + 1]};
}
std::vector<int64_t> ScheduleOutput::SlotsOf(int64_t i) const {
  PYSPEC_CHECK(i >= 0 && i < size(), "entry ", i, " out of range [0, ", size(), ")");
  return {slots.begin() + slot_indptr[i], slots.begin() + slot_indptr[i + 1]};
}

void StepResult::AddPrefill(int64_t id, int64_t num_computed) {
  Entry e;
  e.id = id;
  e.prefill = true;
  e.num_computed = num_computed;
  entries.push_back(std::move(e));
}

void StepResult::AddDecode(int64_t id, std::vector<int32_t> tokens, int64_t num_drafted,
                           int64_t num_accepted, int64_t num_nodes) {
  Entry e;
  e.id = id;
  e.tokens = std::move(tokens);
  e.num_drafted = num_drafted;
  e.num_accepted = num_accepted;
  e.num_nodes = num_nodes;
  entries.push_back(std::move(e));
}

// ---- scheduler -------------------------------------------------------------------------------

Scheduler::Scheduler(const SchedulerConfig& config, int64_t num_blocks, int block_size,
                     bool enable_prefix_cache)
    : Scheduler(config,
                std::make_unique<BlockManager>(num_blocks, block_size, enable_prefix_cache)) {}

Scheduler::Scheduler(const SchedulerConfig& config, std::unique_ptr<BlockManager> block_manager)
    : config_(config), bm_(std::move(block_manager)) {
  config_.Validate();
  initial_config_ = config_;
  PYSPEC_CHECK(bm_ != nullptr, "block_manager must not be null");
  PYSPEC_CHECK(bm_->num_requests() == 0, "the block manager must hold no requests; it holds ",
               bm_->num_requests());
}

Request& Scheduler::Get(int64_t id, const char* what) {
  auto it = requests_.find(id);
  PYSPEC_CHECK(it != requests_.end(), what, ": unknown request id ", id);
  return *it->second;
}

const Request& Scheduler::GetRequest(int64_t id) const {
  auto it = requests_.find(id);
  PYSPEC_CHECK(it != requests_.end(), "GetRequest: unknown request id ", id);
  return *it->second;
}

std::vector<int64_t> Scheduler::finished_ids() const { return finished_; }

void Scheduler::AddRequest(int64_t id, std::vector<int32_t> prompt, SamplingParams params) {
  PYSPEC_CHECK(requests_.count(id) == 0, "AddRequest: request id ", id, " already exists");
  PYSPEC_CHECK(!prompt.empty(), "AddRequest: the prompt must hold at least one token");
  PYSPEC_CHECK(params.max_tokens >= 1, "AddRequest: max_tokens must be >= 1; got ",
               params.max_tokens);
  PYSPEC_CHECK(params.evidence_group >= 0, "AddRequest: evidence_group must be >= 0; got ",
               params.evidence_group);
  auto r = std::make_unique<Request>(id, std::move(prompt), std::move(params), next_arrival_++,
                                     config_.record_transitions);
  r->draft_len = config_.initial_draft_tokens;
  // Its drafter's evidence on this deployment as the request's prior.
  const auto [hits, trials] = DeploymentEvidence(r->params.evidence_group);
  if (trials > 0.0) {
    const double scale = std::min(1.0, kDeploymentPriorTrials / trials);
    r->stats.fb_hits = hits * scale;
    r->stats.fb_trials = trials * scale;
  }
  requests_.emplace(id, std::move(r));
  waiting_.push_back(id);
}

std::pair<double, double> Scheduler::DeploymentEvidence(int32_t evidence_group) const {
  auto it = deploy_fb_.find(evidence_group);
  return it == deploy_fb_.end() ? std::pair<double, double>{0.0, 0.0} : it->second;
}

bool Scheduler::ResetAcceptance(int64_t id, int32_t evidence_group) {
  PYSPEC_CHECK(evidence_group >= -1, "ResetAcceptance(", id, "): evidence_group must be >= 0 "
               "(or -1 to keep the request's); got ", evidence_group);
  Request& r = Get(id, "ResetAcceptance");
  if (r.finished()) return false;
  PYSPEC_CHECK(in_flight_set_.count(id) == 0, "ResetAcceptance(", id,
               "): the request is in the step being run; call it between update() and step()");
  AcceptanceStats& st = r.stats;
  st.ewma = -1.0;
  st.alpha_num = st.alpha_den = 0.0;
  st.fb_hits = st.fb_trials = 0.0;
  if (evidence_group >= 0) r.params.evidence_group = evidence_group;
  r.draft_len = config_.initial_draft_tokens;
  r.probe_wait = 0;
  r.saved_sources.clear();
  if (r.state() == RequestState::kRunningPlain &&
      RunningStateFor(r) == RequestState::kRunningSpeculative) {
    r.TransitionTo(RequestState::kRunningSpeculative);
    r.draft_len = std::max<int64_t>(r.draft_len, 1);
  }
  r.steps_since_switch = 0;
  r.spec_steps_at_switch = st.num_spec_steps;
  r.resume_plain = false;
  r.switch_ewma = -1.0;
  r.switch_steps = 0;
  return true;
}

bool Scheduler::MarkDrafterFailed(int64_t id) {
  Request& r = Get(id, "MarkDrafterFailed");
  if (r.finished()) return false;
  r.drafter_failed = true;
  return true;
}

SwitchReason Scheduler::GetSwitchReason(int64_t id, double switch_below) const {
  const Request& r = GetRequest(id);
  if (r.finished() || !(switch_below > 0.0)) return SwitchReason::kNone;
  if (r.switch_steps == 0) {
    // Started plain on its drafter's losing record here: it would neither draft nor gather
    // evidence to switch on before its first probe.
    const bool started_plain = r.state() == RequestState::kRunningPlain &&
                               r.stats.num_spec_steps == 0 && r.stats.num_cost_fallbacks > 0;
    return started_plain ? SwitchReason::kCostModel : SwitchReason::kNone;
  }
  if (r.switch_steps < kSwitchMinSteps || r.switch_ewma >= switch_below) {
    return SwitchReason::kNone;
  }
  return SwitchReason::kLowAcceptance;
}

void Scheduler::ObserveStepTime(int64_t batch, int64_t tokens, double seconds) {
  cost_.ObserveStep(batch, tokens, seconds);
}

void Scheduler::ObserveDraftTime(int32_t group, double seconds, int64_t levels) {
  cost_.ObserveDraft(group, seconds, levels);
}

void Scheduler::RefitCostModel() {
  const CostModelUpdate u = cost_.Refit(config_.memory_bound_tokens);
  if (u.set_costs) SetCostModel(u.draft_cost, u.verify_cost);
  if (u.memory_bound_tokens) SetMemoryBoundTokens(*u.memory_bound_tokens);
}

bool Scheduler::SetDraftSource(int64_t id, int32_t source) {
  Request& r = Get(id, "SetDraftSource");
  PYSPEC_CHECK(source >= 0 && source < kMaxDraftSources, "SetDraftSource(", id, "): source ",
               source, " is out of range [0, ", kMaxDraftSources, ")");
  if (r.finished()) return false;
  PYSPEC_CHECK(in_flight_set_.count(id) == 0, "SetDraftSource(", id,
               "): the request is in the step being run; call it between update() and step()");
  if (source == r.draft_source) return true;
  const size_t need = static_cast<size_t>(std::max(source, r.draft_source)) + 1;
  if (r.saved_sources.size() < need) r.saved_sources.resize(need);
  AcceptanceStats& st = r.stats;
  r.saved_sources[r.draft_source] = {st.ewma, st.alpha_num, st.alpha_den, r.draft_len};
  const DraftSourceEstimate& next = r.saved_sources[source];
  st.ewma = next.ewma;
  st.alpha_num = next.alpha_num;
  st.alpha_den = next.alpha_den;
  r.draft_len = next.draft_len > 0 ? next.draft_len : config_.initial_draft_tokens;
  r.draft_source = source;
  return true;
}

bool Scheduler::Abort(int64_t id) {
  Request& r = Get(id, "Abort");
  if (r.finished()) return false;
  if (in_flight_set_.erase(id) != 0) aborted_in_flight_.insert(id);
  FinishAndFree(r, FinishReason::kAbort);
  return true;
}

void Scheduler::Release(int64_t id) {
  Request& r = Get(id, "Release");
  PYSPEC_CHECK(r.finished(), "Release: request ", id, " has not finished (state ",
               RequestStateName(r.state()), ")");
  finished_.erase(std::find(finished_.begin(), finished_.end(), id));
  requests_.erase(id);
}

RequestState Scheduler::RunningStateFor(const Request& r) const {
  return r.params.speculative && config_.max_draft_tokens > 0 ? RequestState::kRunningSpeculative
                                                              : RequestState::kRunningPlain;
}

void Scheduler::RemoveFromRunning(int64_t id) {
  auto it = std::find(running_.begin(), running_.end(), id);
  PYSPEC_ICHECK(it != running_.end(), "request ", id, " is not in the running queue");
  running_.erase(it);
}

void Scheduler::RemoveFromWaiting(int64_t id) {
  auto it = std::find(waiting_.begin(), waiting_.end(), id);
  PYSPEC_ICHECK(it != waiting_.end(), "request ", id, " is not in the waiting queue");
  waiting_.erase(it);
}

void Scheduler::FinishAndFree(Request& r, FinishReason reason, std::string message) {
  RequestState s = r.state();
  if (s == RequestState::kWaiting || s == RequestState::kPreempted) {
    RemoveFromWaiting(r.id);
  } else {
    RemoveFromRunning(r.id);
    bm_->Free(r.id);
    r.num_computed = 0;
    pending_freed_.push_back(r.id);
  }
  r.Finish(reason, std::move(message));
  finished_.push_back(r.id);
  pending_finished_.push_back(r.id);
}

void Scheduler::Preempt(Request& r) {
  RemoveFromRunning(r.id);
  bm_->Free(r.id);
  r.num_computed = 0;
  // (A request preempted again while recomputing keeps what it was before the first preemption.)
  r.resume_plain = r.state() == RequestState::kRunningPlain ||
                   (r.state() == RequestState::kPrefill && r.resume_plain);
  r.TransitionTo(RequestState::kPreempted);
  ++r.num_preemptions;
  ++num_preemptions_;
  waiting_.push_front(r.id);
  step_preempted_.push_back(r.id);
  pending_freed_.push_back(r.id);
}

bool Scheduler::Admit(Request& r) {
  PYSPEC_ICHECK(!waiting_.empty() && waiting_.front() == r.id, "admitting a request that is not "
                "at the front of the waiting queue");
  // Recompute after preemption: the prompt and everything generated so far.
  std::vector<int32_t> all = r.AllTokens();
  int64_t cached = bm_->AddRequest(r.id, all);
  if (cached == BlockManager::kNoSpace) return false;
  waiting_.pop_front();
  running_.push_back(r.id);
  r.num_computed = cached;
  r.num_cached_tokens = cached;
  if (cached >= r.num_tokens() - 1) {
    StartRunning(r);
  } else {
    r.TransitionTo(RequestState::kPrefill);
  }
  return true;
}

bool Scheduler::ReserveOrPreempt(Request& r, int64_t extra) {
  while (!bm_->Reserve(r.id, extra)) {
    // Victim: the most recently admitted running request not yet scheduled in this step.
    int64_t victim = -1;
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      if (*it == r.id || in_flight_set_.count(*it) == 0) {
        victim = *it;
        break;
      }
    }
    PYSPEC_ICHECK(victim != -1 || running_.empty(), "no preemption victim");
    if (victim == r.id) {
      if (running_.size() == 1) {
        FinishAndFree(r, FinishReason::kError,
                      detail::StrCat("the KV pool (", bm_->num_total_blocks(), " blocks of ",
                                     bm_->block_size(), " tokens) cannot hold request ", r.id,
                                     " at ", r.num_tokens() + extra, " tokens even alone"));
      } else {
        Preempt(r);
      }
      return false;
    }
    Preempt(*requests_.at(victim));
  }
  return true;
}

int64_t OptimalDraftLength(double alpha, double draft_cost, double verify_cost, int64_t max_len,
                           double* gain) {
  // Draft lengths are tree nodes per step (a TokenTree holds at most 256); the bound keeps the
  // scan below short whatever a caller passes.
  PYSPEC_CHECK(max_len >= 1 && max_len <= kMaxOptimalDraftLength, "max_len must be in [1, ",
               kMaxOptimalDraftLength, "]; got ", max_len);
  PYSPEC_CHECK(std::isfinite(draft_cost) && draft_cost >= 0.0 && std::isfinite(verify_cost) &&
                   verify_cost >= 0.0,
               "draft_cost and verify_cost must be finite and >= 0");
  const double a = std::isfinite(alpha) ? std::min(std::max(alpha, 0.0), 1.0) : 0.0;
  const double c = draft_cost + verify_cost;
  int64_t best = 1;
  double best_gain = -1.0;
  double a_pow = a;        // alpha^gamma
  double expected = 1.0;   // 1 + alpha + ... + alpha^gamma (expected tokens per step)
  for (int64_t g = 1; g <= max_len; ++g) {
    expected += a_pow;
    a_pow *= a;
    const double value = expected / (1.0 + c * static_cast<double>(g));
    if (value > best_gain * (1.0 + 1e-12)) {
      best_gain = value;
      best = g;
    }
  }
  if (gain != nullptr) *gain = best_gain;
  return best;
}

namespace {

// The cost model's gain (expected speedup over plain decoding at the best draft length) at an
// optimistic per-token acceptance: the upper end (two standard errors) of the decayed hit/trial
// evidence with a uniform prior. A request falls back only when even this is below 1, so a
// drafter whose acceptance merely dipped for a few steps keeps drafting, while one that is
// clearly not paying (e.g. right 5% of the time at a quarter of a plain step per draft token,
// after about twenty steps) stops, and a probe that goes no better stops after warmup_steps.
double OptimisticGain(const AcceptanceStats& st, const SchedulerConfig& c) {
  const double n = st.fb_trials + 2.0;
  const double p = (st.fb_hits + 1.0) / n;
  const double upper = std::min(1.0, p + 2.0 * std::sqrt(p * (1.0 - p) / n));
  double gain = 0.0;
  OptimalDraftLength(upper, c.draft_cost, c.verify_cost, c.max_draft_tokens, &gain);
  return gain;
}

}  // namespace

void Scheduler::StartRunning(Request& r) {
  const bool resume_plain = r.resume_plain;
  r.resume_plain = false;
  if (resume_plain && RunningStateFor(r) == RequestState::kRunningSpeculative) {
    // Recomputed after a preemption while plain: plain again, the wait for its probe going on.
    r.TransitionTo(RequestState::kRunningPlain);
    return;
  }
  r.TransitionTo(RunningStateFor(r));
  r.steps_since_switch = 0;
  r.spec_steps_at_switch = r.stats.num_spec_steps;
  // A request that already holds evidence (its drafter's on this deployment, or its own before a
  // preemption) by which even an optimistic acceptance loses starts plain, as if it had fallen
  // back: its first probe comes after probe_interval plain steps. Its drafter's steps would
  // otherwise cost warmup_steps losing steps per request (per recompute) before the first test.
  // The group's evidence fades with each such start (kPlainStartEvidenceDecay), so that among
  // requests too short to probe one drafts again now and then.
  if (r.state() == RequestState::kRunningSpeculative && config_.cost_model &&
      r.stats.fb_trials > 0.0 && OptimisticGain(r.stats, config_) < 1.0) {
    r.TransitionTo(RequestState::kRunningPlain);
    r.probe_wait = std::max(r.probe_wait, config_.probe_interval);
    ++r.stats.num_cost_fallbacks;
    auto it = deploy_fb_.find(r.params.evidence_group);
    if (it != deploy_fb_.end()) {
      it->second.first *= kPlainStartEvidenceDecay;
      it->second.second *= kPlainStartEvidenceDecay;
    }
  }
}

void Scheduler::SetCostModel(double draft_cost, double verify_cost) {
  SchedulerConfig c = config_;
  c.draft_cost = draft_cost;
  c.verify_cost = verify_cost;
  c.Validate();
  config_ = c;
}

void Scheduler::ResetPolicy() {
  config_ = initial_config_;
  cost_ = StepCostModel();
  deploy_fb_.clear();
  deploy_ewma_ = -1.0;
}

void Scheduler::SetSpecBudget(int64_t spec_token_budget, int64_t spec_disable_batch_size) {
  SchedulerConfig c = config_;
  c.spec_token_budget = spec_token_budget;
  c.spec_disable_batch_size = spec_disable_batch_size;
  c.Validate();
  config_ = c;
}

int64_t Scheduler::SpecShare(int64_t n_running, int64_t n_spec) const {
  if (config_.max_draft_tokens == 0 || n_spec <= 0) return 0;
  if (config_.spec_disable_batch_size > 0 && n_running >= config_.spec_disable_batch_size) return 0;
  int64_t share = config_.spec_token_budget == 0
                      ? config_.max_draft_tokens
                      : std::min(config_.max_draft_tokens, config_.spec_token_budget / n_spec);
  if (config_.memory_bound_tokens > 0) {
    const int64_t free = config_.memory_bound_tokens - n_running;
    share = free <= 0 ? 0 : std::min(share, free / n_spec);
  }
  return share;
}

void Scheduler::SetMemoryBoundTokens(int64_t tokens) {
  PYSPEC_CHECK(tokens >= 0, "memory_bound_tokens must be >= 0; got ", tokens);
  config_.memory_bound_tokens = tokens;
}

void Scheduler::Emit(ScheduleOutput& out, Request& r, StepKind kind,
                     const std::vector<int32_t>& toks, int64_t budget, int64_t num_slots) {
  out.ids.push_back(r.id);
  out.kinds.push_back(kind);
  out.logits.push_back(kind == StepKind::kPrefill    ? LogitsKind::kNone
                       : kind == StepKind::kDecode ? LogitsKind::kLast
                                                   : LogitsKind::kAll);
  out.start_pos.push_back(r.num_computed);
  out.draft_budget.push_back(budget);
  out.tokens.insert(out.tokens.end(), toks.begin(), toks.end());
  out.token_indptr.push_back(static_cast<int64_t>(out.tokens.size()));
  const std::vector<int32_t>& table = bm_->BlockTable(r.id);
  out.block_tables.insert(out.block_tables.end(), table.begin(), table.end());
  out.block_indptr.push_back(static_cast<int64_t>(out.block_tables.size()));
  size_t at = out.slots.size();
  out.slots.resize(at + static_cast<size_t>(num_slots));
  bm_->SlotsFor(r.id, r.num_computed, num_slots, out.slots.data() + at);
  out.slot_indptr.push_back(static_cast<int64_t>(out.slots.size()));
  in_flight_set_[r.id] = Scheduled{kind, kind == StepKind::kPrefill
                                             ? static_cast<int64_t>(toks.size())
                                             : budget};
}

ScheduleOutput Scheduler::Step() {
  PYSPEC_CHECK(!in_flight_, "Step: the previous Step() has not been applied with Update()");
  ScheduleOutput out;
  in_flight_set_.clear();
  aborted_in_flight_.clear();
  step_preempted_.clear();
  int64_t budget = config_.max_num_batched_tokens;

  // 1. Running (decode-phase) requests, oldest first.
  std::vector<int64_t> decode_ids;
  int64_t n_spec = 0;
  for (int64_t id : running_) {
    const Request& r = *requests_.at(id);
    if (IsRunning(r.state())) {
      decode_ids.push_back(id);
      n_spec += r.state() == RequestState::kRunningSpeculative;
    }
  }
  const int64_t share = SpecShare(static_cast<int64_t>(decode_ids.size()), n_spec);
  for (int64_t id : decode_ids) {
    if (budget < 1) break;
    Request& r = *requests_.at(id);
    if (!IsRunning(r.state())) continue;  // preempted as a victim in this step
    int64_t b = 0;
    if (r.state() == RequestState::kRunningSpeculative) {
      b = std::min({r.draft_len, share, r.params.max_tokens - r.num_generated() - 1, budget - 1});
      b = std::max<int64_t>(b, 0);
      // Shrink speculation before preempting anybody.
      if (b > 0 && !bm_->CanReserve(id, 1 + b)) b = 0;
    }
    if (!ReserveOrPreempt(r, 1 + b)) continue;
    Emit(out, r, b > 0 ? StepKind::kSpeculative : StepKind::kDecode, {r.last_token()}, b, 1 + b);
    budget -= 1 + b;
  }

  // 2a. Prefill chunks of requests already prefilling.
  auto chunk_of = [&](const Request& r) {
    int64_t c = std::min(r.num_tokens() - 1 - r.num_computed, budget);
    if (config_.max_prefill_chunk > 0) c = std::min(c, config_.max_prefill_chunk);
    return c;
  };
  auto schedule_prefill = [&](Request& r) {
    int64_t c = chunk_of(r);
    PYSPEC_ICHECK(c > 0, "request ", r.id, " in PREFILL with nothing to compute");
    if (!ReserveOrPreempt(r, 0)) return;
    std::vector<int32_t> all = r.AllTokens();
    std::vector<int32_t> chunk(all.begin() + r.num_computed, all.begin() + r.num_computed + c);
    Emit(out, r, StepKind::kPrefill, chunk, 0, c);
    budget -= c;
  };
  std::vector<int64_t> prefill_ids;
  for (int64_t id : running_) {
    if (requests_.at(id)->state() == RequestState::kPrefill) prefill_ids.push_back(id);
  }
  // A short prompt first: with a chunk limit, a waiting request whose prompt fits one chunk is
  // admitted in a step without the chunks of prompts already prefilling (such a step costs about
  // as much as its chunk), so its first token does not wait a long prompt's chunk step. At most
  // every other step leaves those chunks out: a stream of short prompts cannot starve a long one.
  auto fits_one_chunk = [&](int64_t id) {
    return requests_.at(id)->num_tokens() - 1 <= config_.max_prefill_chunk;
  };
  const bool short_first = config_.max_prefill_chunk > 0 && !prefill_ids.empty() &&
                           !skipped_prefill_chunks_ && !waiting_.empty() &&
                           step_preempted_.empty() && fits_one_chunk(waiting_.front()) &&
                           static_cast<int64_t>(running_.size()) < config_.max_num_seqs;
  skipped_prefill_chunks_ = short_first;
  for (int64_t id : prefill_ids) {
    if (budget < 1 || short_first) break;
    Request& r = *requests_.at(id);
    if (r.state() != RequestState::kPrefill) continue;
    schedule_prefill(r);
  }

  // 2b. Admit waiting requests (FCFS) while budget and sequence slots remain; not in a step that
  // had to preempt (the pool is under pressure, and a victim would be re-admitted at once). In a
  // short-first step, only prompts that fit one chunk (the next long one waits a step).
  while (budget >= 1 && !waiting_.empty() && step_preempted_.empty() &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs &&
         !(short_first && !fits_one_chunk(waiting_.front()))) {
    Request& r = *requests_.at(waiting_.front());
    if (!Admit(r)) {
      if (!running_.empty()) break;  // wait for running requests to release KV
      FinishAndFree(r, FinishReason::kError,
                    detail::StrCat("the KV pool (", bm_->num_total_blocks(), " blocks of ",
                                   bm_->block_size(), " tokens) cannot hold the ", r.num_tokens(),
                                   " tokens of request ", r.id, " even alone"));
      continue;
    }
    if (r.state() == RequestState::kPrefill) {
      schedule_prefill(r);
    } else {
      // Fully cached prompt (or a 1-token prompt): decode its root right away, without drafts.
      if (bm_->CanReserve(r.id, 1) && ReserveOrPreempt(r, 1)) {
        Emit(out, r, StepKind::kDecode, {r.last_token()}, 0, 1);
        budget -= 1;
      }
    }
  }

  if (config_.measure_costs && cost_.CalibrationDue()) Calibrate(out);

  out.pending_copies = bm_->TakePendingCopies();
  out.preempted_ids = step_preempted_;
  out.finished_ids = std::move(pending_finished_);
  out.freed_ids = std::move(pending_freed_);
  pending_finished_.clear();
  pending_freed_.clear();
  in_flight_ = true;
  ++num_steps_;
  return out;
}

void Scheduler::Calibrate(ScheduleOutput& out) {
  // A calibration step is decode-only (prefill runs at another rate): the step-time fit needs
  // plain steps of the batch it sees.
  for (StepKind k : out.kinds) {
    if (k == StepKind::kPrefill) return;
  }
  bool held = false;  // (a step in which nothing would have drafted is not one)
  for (int64_t i = 0; i < out.size(); ++i) {
    if (out.kinds[i] != StepKind::kSpeculative || requests_.at(out.ids[i])->drafter_failed) {
      continue;
    }
    out.kinds[i] = StepKind::kDecode;
    out.logits[i] = LogitsKind::kLast;
    out.draft_budget[i] = 0;
    in_flight_set_[out.ids[i]] = Scheduled{StepKind::kDecode, 0};
    held = true;
  }
  if (held) cost_.OnCalibration();
}

std::vector<RequestOutput> Scheduler::Update(const StepResult& result) {
  PYSPEC_CHECK(in_flight_, "Update: no Step() to apply");
  // Validate everything first so that a bad result changes nothing.
  std::unordered_set<int64_t> seen;
  for (const StepResult::Entry& e : result.entries) {
    PYSPEC_CHECK(seen.insert(e.id).second, "Update: request ", e.id, " appears twice");
    if (aborted_in_flight_.count(e.id) != 0) continue;
    auto it = in_flight_set_.find(e.id);
    PYSPEC_CHECK(it != in_flight_set_.end(), "Update: request ", e.id,
                 " was not scheduled in the last step");
    const Scheduled& s = it->second;
    if (s.kind == StepKind::kPrefill) {
      PYSPEC_CHECK(e.prefill, "Update: request ", e.id, " was scheduled for prefill; got a "
                   "decode result");
      PYSPEC_CHECK(e.num_computed >= 0 && e.num_computed <= s.count, "Update: request ", e.id,
                   ": num_computed must be in [0, ", s.count, "]; got ", e.num_computed);
    } else {
      PYSPEC_CHECK(!e.prefill, "Update: request ", e.id, " was scheduled for decode; got a "
                   "prefill result");
      int64_t n = static_cast<int64_t>(e.tokens.size());
      PYSPEC_CHECK(n >= 1 && n <= s.count + 1, "Update: request ", e.id, " must emit between 1 "
                   "and ", s.count + 1, " tokens; got ", n);
      PYSPEC_CHECK(e.num_drafted >= 0 && e.num_drafted <= s.count, "Update: request ", e.id,
                   ": num_drafted must be in [0, ", s.count, "]; got ", e.num_drafted);
      PYSPEC_CHECK(e.num_accepted == n - 1 && e.num_accepted <= e.num_drafted, "Update: request ",
                   e.id, ": num_accepted must equal len(tokens) - 1 and be <= num_drafted; got ",
                   e.num_accepted);
    }
  }

  if (config_.measure_costs && !result.entries.empty()) {
    for (const StepResult::Entry& e : result.entries) {
      if (!e.prefill && e.num_drafted > 0) {
        cost_.ObserveTree(e.num_nodes >= 0 ? e.num_nodes : e.num_drafted, e.num_drafted);
      }
    }
    if (++adaptive_steps_ % kRefitInterval == 0) RefitCostModel();
  }

  std::vector<RequestOutput> outputs;
  for (const StepResult::Entry& e : result.entries) {
    if (aborted_in_flight_.count(e.id) != 0) continue;
    Request& r = *requests_.at(e.id);
    RequestOutput o;
    o.id = e.id;
    if (e.prefill) {
      if (e.num_computed > 0) bm_->MarkComputed(r.id, e.num_computed);
      r.num_computed += e.num_computed;
      if (r.num_computed == r.num_tokens() - 1) StartRunning(r);
    } else {
      ApplyDecode(r, e, o);
    }
    outputs.push_back(std::move(o));
  }
  in_flight_set_.clear();
  aborted_in_flight_.clear();
  in_flight_ = false;
  return outputs;
}

void Scheduler::ApplyDecode(Request& r, const StepResult::Entry& e, RequestOutput& o) {
  const int64_t a = e.num_accepted;
  FinishReason finish = FinishReason::kNone;
  for (int32_t t : e.tokens) {
    o.new_tokens.push_back(t);
    if (std::find(r.params.stop_token_ids.begin(), r.params.stop_token_ids.end(), t) !=
        r.params.stop_token_ids.end()) {
      finish = FinishReason::kStop;
      break;
    }
    if (r.num_generated() + static_cast<int64_t>(o.new_tokens.size()) >= r.params.max_tokens) {
      finish = FinishReason::kLength;
      break;
    }
  }
  const int64_t k = static_cast<int64_t>(o.new_tokens.size());
  // Materialized positions: the root and the accepted drafts (a + 1), but only those that are
  // kept (the root and the first k - 1 emitted tokens when the tail was dropped).
  const int64_t computed = std::min(a, k) + 1;
  PYSPEC_ICHECK(bm_->Commit(r.id, o.new_tokens, computed), "request ", r.id,
                ": commit failed although its capacity was reserved");
  r.generated.insert(r.generated.end(), o.new_tokens.begin(), o.new_tokens.end());
  r.num_computed += computed;
  ++r.num_decode_steps;
  ++r.steps_since_switch;

  AcceptanceStats& st = r.stats;
  double cost_gain = 2.0;  // set by the cost model when it runs this step
  if (e.num_drafted > 0) {
    ++st.num_spec_steps;
    st.num_draft_tokens += e.num_drafted;
    st.num_accepted_tokens += a;
    if (static_cast<int64_t>(st.accepted_at.size()) < a) st.accepted_at.resize(a, 0);
    for (int64_t i = 0; i < a; ++i) ++st.accepted_at[i];
    double rate = static_cast<double>(a) / static_cast<double>(e.num_drafted);
    st.ewma = st.ewma < 0 ? rate : config_.ewma_alpha * rate + (1 - config_.ewma_alpha) * st.ewma;
    r.switch_ewma = r.switch_ewma < 0 ? rate
                                      : (1 - kSwitchEwmaWeight) * r.switch_ewma +
                                            kSwitchEwmaWeight * rate;
    ++r.switch_steps;
    const double da = config_.deployment_ewma_alpha;
    deploy_ewma_ = deploy_ewma_ < 0 ? rate : (1 - da) * deploy_ewma_ + da * rate;
    const double trials = static_cast<double>(a + (a < e.num_drafted ? 1 : 0));
    if (st.alpha_den <= 0.0) {
      st.alpha_num = static_cast<double>(a);
      st.alpha_den = trials;
    } else {
      st.alpha_num = config_.ewma_alpha * a + (1 - config_.ewma_alpha) * st.alpha_num;
      st.alpha_den = config_.ewma_alpha * trials + (1 - config_.ewma_alpha) * st.alpha_den;
    }
    st.fb_hits = kFallbackEvidenceDecay * st.fb_hits + static_cast<double>(a);
    st.fb_trials = kFallbackEvidenceDecay * st.fb_trials + trials;
    auto& [group_hits, group_trials] = deploy_fb_[r.params.evidence_group];
    group_hits = kDeploymentEvidenceDecay * group_hits + static_cast<double>(a);
    group_trials = kDeploymentEvidenceDecay * group_trials + trials;
    if (!config_.adapt_draft_length) {
      // (a fixed shape: draft_len stays)
    } else if (config_.cost_model) {
      r.draft_len = OptimalDraftLength(st.TokenAcceptance(), config_.draft_cost,
                                       config_.verify_cost, config_.max_draft_tokens);
      cost_gain = OptimisticGain(st, config_);
    } else if (a == e.num_drafted) {
      r.draft_len = std::min(r.draft_len + 1, config_.max_draft_tokens);
    } else if (2 * a < e.num_drafted) {
      r.draft_len = std::max<int64_t>(r.draft_len - 1, 1);
    }
  }

  if (finish != FinishReason::kNone) {
    o.finished = true;
    o.finish_reason = finish;
    FinishAndFree(r, finish);
    return;
  }
  // Adaptive speculation: fall back to plain decoding when acceptance is too low; probe later.
  const bool warm = r.state() == RequestState::kRunningSpeculative &&
                    r.steps_since_switch >= config_.warmup_steps && st.ewma >= 0.0;
  const bool low = warm && config_.min_acceptance_rate > 0.0 &&
                   st.ewma < config_.min_acceptance_rate;
  const bool no_gain = warm && config_.cost_model && cost_gain < 1.0;
  if (low || no_gain) {
    // A run that drafted for probe_interval steps or more paid for a while: probe again at the
    // base interval. A shorter one after an earlier fallback was a probe that went no better.
    const int64_t base = config_.probe_interval;
    const int64_t drafted = st.num_spec_steps - r.spec_steps_at_switch;
    r.probe_wait = drafted >= base || r.probe_wait == 0
                       ? base
                       : std::min(2 * r.probe_wait, kMaxProbeBackoff * base);
    r.TransitionTo(RequestState::kRunningPlain);
    r.steps_since_switch = 0;
    r.spec_steps_at_switch = st.num_spec_steps;
    ++(low ? st.num_fallbacks : st.num_cost_fallbacks);
  } else if (r.state() == RequestState::kRunningPlain && RunningStateFor(r) ==
                 RequestState::kRunningSpeculative &&
             r.steps_since_switch >= std::max(r.probe_wait, config_.probe_interval)) {
    r.TransitionTo(RequestState::kRunningSpeculative);
    r.steps_since_switch = 0;
    r.spec_steps_at_switch = st.num_spec_steps;
    st.ewma = -1.0;  // the probe is judged on fresh evidence
    st.alpha_num = st.alpha_den = 0.0;
    ++st.num_probes;
    r.draft_len = std::max<int64_t>(r.draft_len, 1);
  }
}

void Scheduler::CheckInvariants() const {
  auto fail = [](const std::string& m) { throw RuntimeError("Scheduler invariant: " + m); };
  std::unordered_map<int64_t, int> in_waiting, in_running, in_finished;
  for (int64_t id : waiting_) ++in_waiting[id];
  for (int64_t id : running_) ++in_running[id];
  for (int64_t id : finished_) ++in_finished[id];
  if (static_cast<int64_t>(running_.size()) > config_.max_num_seqs) fail("too many running");
  if (bm_->num_requests() != static_cast<int64_t>(running_.size())) {
    fail(detail::StrCat("block manager holds ", bm_->num_requests(), " requests; running ",
                        running_.size()));
  }
  for (const auto& kv : requests_) {
    const Request& r = *kv.second;
    int64_t id = kv.first;
    if (r.id != id) fail("id mismatch");
    int w = in_waiting.count(id) ? in_waiting[id] : 0;
    int u = in_running.count(id) ? in_running[id] : 0;
    int f = in_finished.count(id) ? in_finished[id] : 0;
    if (w + u + f != 1) fail(detail::StrCat("request ", id, " is in ", w + u + f, " queues"));
    RequestState s = r.state();
    bool want_w = s == RequestState::kWaiting || s == RequestState::kPreempted;
    bool want_u = s == RequestState::kPrefill || IsRunning(s);
    bool want_f = s == RequestState::kFinished;
    if ((w == 1) != want_w || (u == 1) != want_u || (f == 1) != want_f) {
      fail(detail::StrCat("request ", id, " in state ", RequestStateName(s), " is in the wrong "
                          "queue"));
    }
    if (r.num_generated() > r.params.max_tokens) fail(detail::StrCat("request ", id, " overran"));
    if (want_u) {
      if (!bm_->HasRequest(id)) fail(detail::StrCat("running request ", id, " holds no KV"));
      if (bm_->NumComputed(id) != r.num_computed || bm_->NumTokens(id) != r.num_tokens()) {
        fail(detail::StrCat("request ", id, " disagrees with the block manager"));
      }
      if (IsRunning(s) && r.num_computed != r.num_tokens() - 1) {
        fail(detail::StrCat("running request ", id, " has num_computed ", r.num_computed));
      }
      if (s == RequestState::kPrefill && r.num_computed >= r.num_tokens() - 1) {
        fail(detail::StrCat("prefilling request ", id, " has nothing left to compute"));
      }
    } else if (bm_->HasRequest(id)) {
      fail(detail::StrCat("request ", id, " in state ", RequestStateName(s), " holds KV"));
    }
    if (want_f && r.finish_reason() == FinishReason::kNone) fail("finished without a reason");
    if (!want_f && r.finish_reason() != FinishReason::kNone) fail("reason while unfinished");
  }
  if (in_waiting.size() + in_running.size() + in_finished.size() != requests_.size()) {
    fail("a queue holds an unknown request");
  }
  bm_->CheckInvariants();
}

}  // namespace pyspec
