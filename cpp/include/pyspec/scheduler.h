// Continuous-batching scheduler with chunked prefill and batch-aware speculation (DESIGN section
// 2, "Scheduler"; records: section 3).
//
// One engine thread drives it:  out = Step();  runner runs `out`;  Update(result);  repeat.
//
// Step() builds one flattened forward under two limits, max_num_batched_tokens (tokens run) and
// max_num_seqs (requests holding KV: PREFILL + RUNNING):
//   1. Running requests first, oldest first. Each runs its root (last token) plus up to
//      draft_budget draft tokens (tree nodes), so it costs 1 + draft_budget tokens; the KV for the
//      accepted path + bonus token is reserved up front: BlockManager::Reserve(id, 1 + budget).
//   2. Then prefill chunks: requests already in PREFILL (oldest first), then newly admitted ones
//      from the front of the waiting queue (FCFS; admission allocates the whole prompt through
//      BlockManager::AddRequest, whose prefix-cache hit skips the cached tokens). A chunk is as
//      long as the remaining token budget allows (and max_prefill_chunk, if set). With
//      max_prefill_chunk set, a waiting request whose prompt fits one chunk is admitted in a step
//      that leaves the other prefill chunks out (at most every other step), so a short prompt's
//      first token does not wait behind a long prompt's chunks.
//   If a reservation fails, the newest running request not yet scheduled in this step is preempted
//   (KV freed, state PREEMPTED, pushed to the front of the waiting queue; it is re-prefilled later
//   by recompute over prompt + generated tokens) and the reservation is retried. A request that
//   cannot get its KV while it is the only request holding KV finishes with ERROR.
//
// Batch-aware speculation budget (so speculation never lowers throughput):
//   n = running (decode-phase) requests at the start of Step();
//   n >= spec_disable_batch_size (> 0)     -> budget 0 for everyone (compute-bound: plain decode);
//   otherwise share = spec_token_budget / (running requests in RUNNING_SPECULATIVE), and
//   budget(request) = min(request.draft_len, max_draft_tokens, share,
//                         max_tokens - generated - 1, remaining step token budget - 1).
// draft_len adapts per request. With cost_model (Leviathan et al. 2023, section 3.4): the request's
// per-token acceptance alpha is estimated from its steps as a truncated geometric (EWMA of accepted
// tokens over EWMA of trials, trials = accepted + 1 when a draft token was rejected), and draft_len
// is the gamma in [1, max_draft_tokens] that maximizes expected tokens per unit of time,
//   (1 - alpha^(gamma+1)) / (1 - alpha)  /  (1 + (draft_cost + verify_cost) * gamma),
// where draft_cost is the drafter's cost per draft token and verify_cost the target's marginal
// cost per extra verified token, both relative to one plain decode step (SetCostModel, or with
// measure_costs the scheduler's own fit of the step times the engine reports). For trees, gamma
// counts nodes and alpha is estimated the same way (a conservative approximation: a tree accepts
// at least as much as a chain with that alpha).
// When even the best gamma is predicted slower than plain decoding at an optimistic alpha (the
// upper end, two standard errors, of the accepted/trial counts of about the last twenty
// speculative steps, with a uniform prior, kept across fallbacks), the request falls back to
// RUNNING_PLAIN (counted as a cost fallback): a dip in acceptance for a few steps is noise, not
// evidence that drafting loses. A new request starts with its evidence group's (its drafter's)
// recent evidence on this deployment, worth at most kDeploymentPriorTrials trials (request.h), and
// starts plain (a cost fallback) where that evidence already fails the test. Without cost_model:
// +1 after a step that accepted every draft token, -1 (not below 1) after one that accepted fewer
// than half. A request whose acceptance EWMA (weight ewma_alpha) is below min_acceptance_rate
// after warmup_steps speculative steps falls back to RUNNING_PLAIN. A request that fell back is
// probed again (back to RUNNING_SPECULATIVE) after probe_interval plain steps; a probe that falls
// back again within probe_interval steps doubles its wait before the next one (up to
// kMaxProbeBackoff times probe_interval).
// With measure_costs (adaptive.h), draft_cost, verify_cost and memory_bound_tokens are measured:
// the engine reports step and draft times (ObserveStepTime / ObserveDraftTime), Update() feeds the
// verified trees' sizes and refits every kRefitInterval steps, and a decode-only step after
// kCalibrationSteps in a row that all drafted is a calibration step: its speculative entries are
// scheduled as plain decode steps (their KV reservation kept), except those of a request whose
// drafter failed (MarkDrafterFailed). A request's drafter-switching
// evidence (GetSwitchReason) and the deployment's acceptance average are kept here too.
//
// Update() applies the runner's results: prefill -> MarkComputed; decode -> Commit(emitted tokens,
// num_computed = accepted + 1), stats/EWMA, stop conditions (a stop token ends the request and the
// tokens emitted after it are dropped; max_tokens truncates), state moves, and frees the KV of
// finished requests at once. Finished requests stay queryable (GetRequest) until Release(id).
//
// Not thread-safe (thread-compatible): no globals; one instance per engine.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "pyspec/adaptive.h"
#include "pyspec/block_manager.h"
#include "pyspec/request.h"

namespace pyspec {

struct SchedulerConfig {
  int64_t max_num_batched_tokens = 2048;  // tokens run per step (>= 1)
  int64_t max_num_seqs = 64;              // requests holding KV (>= 1)
  int64_t max_prefill_chunk = 0;          // 0: limited by the token budget only
  int64_t max_draft_tokens = 8;           // per request per step (tree nodes beyond the root)
  int64_t initial_draft_tokens = 4;       // a request's starting draft_len (1..max_draft_tokens)
  int64_t spec_token_budget = 64;         // draft tokens per step shared by all; 0 = unlimited
  int64_t spec_disable_batch_size = 32;   // batch size at which speculation stops; 0 = never
  double ewma_alpha = 0.2;                // weight of the newest acceptance rate, in (0, 1]
  double min_acceptance_rate = 0.0;       // fall back to PLAIN below this EWMA (0 = never)
  int64_t warmup_steps = 4;               // speculative steps before a fallback is considered
  int64_t probe_interval = 32;            // plain steps before speculation is probed again (base)
  bool record_transitions = false;        // keep Request::history (tests)
  bool cost_model = false;                // draft_len from the Leviathan cost model (see above)
  // false: draft_len stays at initial_draft_tokens whatever is accepted (no cost model, no
  // heuristic): measurements of one fixed draft shape.
  bool adapt_draft_length = true;
  // Tokens a step can run before its forward turns compute-bound (SetMemoryBoundTokens, or with
  // measure_costs the scheduler's fit; 0 = unknown). When set, the draft tokens of a step are
  // limited to what is left of it after the batch's own tokens: none once the batch alone
  // reaches it.
  int64_t memory_bound_tokens = 0;
  double draft_cost = 0.0;                // per draft token, relative to a plain step (>= 0)
  double verify_cost = 0.02;              // per extra verified token, relative to a plain step
  // Measure the cost model's ratios and the memory-bound limit from the step times the engine
  // reports (ObserveStepTime / ObserveDraftTime; adaptive.h), refit every kRefitInterval steps,
  // and run calibration steps.
  bool measure_costs = false;
  // Weight of the newest speculative step in the deployment-wide acceptance average (reporting).
  double deployment_ewma_alpha = 2.0 / 65.0;

  void Validate() const;  // throws ValueError
};

// The longest draft OptimalDraftLength scans (a ValueError above).
constexpr int64_t kMaxOptimalDraftLength = 4096;
// The Leviathan et al. optimum: the gamma in [1, max_len] maximizing expected tokens per unit time
// (formula above) for per-token acceptance `alpha` in [0, 1]; `*gain` (optional) receives that
// maximum relative to plain decoding (> 1: speculation pays).
int64_t OptimalDraftLength(double alpha, double draft_cost, double verify_cost, int64_t max_len,
                           double* gain = nullptr);

enum class StepKind : uint8_t { kPrefill = 0, kDecode = 1, kSpeculative = 2 };
// Which logits rows the runner must return for a scheduled request.
enum class LogitsKind : uint8_t { kNone = 0, kLast = 1, kAll = 2 };
const char* StepKindName(StepKind k);

// One step's batch, flattened (DESIGN 3). Entry i is request ids[i]:
//   tokens[token_indptr[i] : token_indptr[i+1]]   tokens to run: the prefill chunk, or the root
//   start_pos[i]                                   position of the first of them (= num_computed)
//   block_tables[block_indptr[i] : ...]            the request's block table
//   slots[slot_indptr[i] : ...]                    flat KV slots (block * block_size + offset) of
//       the positions that will be committed: the chunk for prefill; for decode/speculative,
//       positions start_pos .. start_pos + draft_budget (root + every draft depth); the runner
//       materializes the accepted path (root + accepted drafts) into the first accepted + 1.
//   draft_budget[i]                                 max draft tokens / tree nodes beyond the root
//   kinds[i], logits[i]
// The runner must perform pending_copies (copy-on-write, (src_block, dst_block), in order) before
// the forward. preempted_ids: preempted in this step. finished_ids: finished since the last Step
// (by Update or Abort; their KV is already freed). freed_ids: every request whose KV was released
// since the last Step (finished or preempted): the runner drops its per-request state.
struct ScheduleOutput {
  std::vector<int64_t> ids;
  std::vector<StepKind> kinds;
  std::vector<LogitsKind> logits;
  std::vector<int64_t> start_pos;
  std::vector<int64_t> draft_budget;
  std::vector<int32_t> tokens;
  std::vector<int64_t> token_indptr{0};
  std::vector<int32_t> block_tables;
  std::vector<int64_t> block_indptr{0};
  std::vector<int64_t> slots;
  std::vector<int64_t> slot_indptr{0};
  std::vector<std::pair<int32_t, int32_t>> pending_copies;
  std::vector<int64_t> preempted_ids;
  std::vector<int64_t> finished_ids;
  std::vector<int64_t> freed_ids;

  int64_t size() const { return static_cast<int64_t>(ids.size()); }
  bool empty() const { return ids.empty(); }
  // Tokens run by the forward, not counting draft tokens (those are bounded by draft_budget).
  int64_t num_scheduled_tokens() const { return token_indptr.back(); }
  // Upper bound on tokens run including drafts (what the token budget limits).
  int64_t num_budgeted_tokens() const;
  std::vector<int32_t> TokensOf(int64_t i) const;
  std::vector<int32_t> BlockTableOf(int64_t i) const;
  std::vector<int64_t> SlotsOf(int64_t i) const;
};

// The runner's results for one ScheduleOutput. Entries for requests that were not scheduled in the
// last step are a ValueError; entries for requests aborted since are ignored; a scheduled request
// without an entry simply made no progress.
struct StepResult {
  struct Entry {
    int64_t id = 0;
    bool prefill = false;
    int64_t num_computed = 0;     // prefill: tokens of the chunk whose KV is now in the pages
    std::vector<int32_t> tokens;  // decode: accepted drafts + bonus/recovered token (>= 1)
    int64_t num_drafted = 0;      // decode: draft tokens / tree nodes verified
    int64_t num_accepted = 0;     // decode: accepted drafts (= tokens.size() - 1)
    // decode: the verified tree's nodes beyond the root when num_drafted counts its levels (the
    // cost model's nodes per level); -1: num_drafted itself.
    int64_t num_nodes = -1;
  };
  std::vector<Entry> entries;

  void AddPrefill(int64_t id, int64_t num_computed);
  void AddDecode(int64_t id, std::vector<int32_t> tokens, int64_t num_drafted,
                 int64_t num_accepted, int64_t num_nodes = -1);
};

// Why a request should move to another drafter (Scheduler::SwitchReason).
enum class SwitchReason : uint8_t {
  kNone = 0,
  kLowAcceptance,  // its acceptance average stayed below the threshold
  kCostModel,      // it started plain on its drafter's evidence and has not drafted since
};
const char* SwitchReasonName(SwitchReason r);

// What Update() changed per request: the tokens kept this step (for streaming) and whether it
// finished.
struct RequestOutput {
  int64_t id = 0;
  std::vector<int32_t> new_tokens;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
};

class Scheduler {
 public:
  // Owns a new BlockManager(num_blocks, block_size, enable_prefix_cache).
  Scheduler(const SchedulerConfig& config, int64_t num_blocks, int block_size,
            bool enable_prefix_cache = true);
  // Takes a given BlockManager (it must hold no requests).
  Scheduler(const SchedulerConfig& config, std::unique_ptr<BlockManager> block_manager);

  // Queues a request (state WAITING). Throws ValueError for a duplicate id, an empty prompt or
  // max_tokens < 1.
  void AddRequest(int64_t id, std::vector<int32_t> prompt, SamplingParams params);
  // Finishes the request with ABORT from any unfinished state, releasing its KV at once. Returns
  // false if it had already finished. Throws ValueError for an unknown id.
  bool Abort(int64_t id);
  // Forgets a finished request. Throws ValueError if unknown or not finished.
  void Release(int64_t id);
  // Another drafter now serves request `id`: the acceptance evidence gathered about the previous
  // one (EWMA, cost-model estimate, fallback test) is dropped, draft_len starts over at
  // initial_draft_tokens, and a request that fell back to plain decoding speculates again (when
  // it may). Call between Update() and Step(). Lifetime counters stay. False if the request has
  // finished; throws ValueError for an unknown id.
  // `evidence_group` (>= 0; -1 keeps the request's) is the new drafter's group: the request's
  // speculative steps count towards that group's deployment evidence from now on.
  bool ResetAcceptance(int64_t id, int32_t evidence_group = -1);
  // The next steps of request `id` are drafted by source `source` (in [0, kMaxDraftSources)): a
  // part of a combined drafter, a prompt-lookup match length. Each source keeps its own acceptance
  // estimate (EWMA and the cost model's alpha) and draft_len; this makes `source`'s current (a
  // source never used starts at initial_draft_tokens with no evidence) and keeps the previous one's
  // for its next turn. The fallback test's evidence and the lifetime counters stay per request:
  // whether drafting pays at all is judged over every source. Call between Update() and Step().
  // False if the request has finished; throws ValueError for an unknown id, a source out of range
  // or mid-step.
  bool SetDraftSource(int64_t id, int32_t source);

  // Builds the next batch. Throws ValueError if the previous Step() was not followed by Update().
  ScheduleOutput Step();
  // Applies the runner's results for the last Step(). Throws ValueError (changing nothing) for an
  // entry that does not match what was scheduled.
  std::vector<RequestOutput> Update(const StepResult& result);

  // ---- queries ----
  bool HasRequest(int64_t id) const { return requests_.count(id) != 0; }
  const Request& GetRequest(int64_t id) const;
  int64_t num_requests() const { return static_cast<int64_t>(requests_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_unfinished() const { return num_waiting() + num_running(); }
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  bool step_in_flight() const { return in_flight_; }
  const std::deque<int64_t>& waiting_queue() const { return waiting_; }
  const std::vector<int64_t>& running_queue() const { return running_; }
  std::vector<int64_t> finished_ids() const;
  const BlockManager& block_manager() const { return *bm_; }
  const SchedulerConfig& config() const { return config_; }
  int64_t num_steps() const { return num_steps_; }
  int64_t num_preemptions() const { return num_preemptions_; }
  // The batch-aware share rule alone: per-request draft budget cap when n requests run and
  // n_spec of them speculate (before draft_len / room / token-budget limits).
  int64_t SpecShare(int64_t n_running, int64_t n_spec) const;
  // Updates the cost model's measured ratios (both finite, >= 0). Throws ValueError.
  void SetCostModel(double draft_cost, double verify_cost);
  // Updates the batch-aware speculation limits (same meaning and checks as the config fields):
  // an engine that measures when its forward turns compute-bound narrows them at run time.
  void SetSpecBudget(int64_t spec_token_budget, int64_t spec_disable_batch_size);
  void SetMemoryBoundTokens(int64_t tokens);  // >= 0; see SchedulerConfig
  // The speculation policy back to where it started (a rollback): the configuration given to
  // the constructor (costs, batch-aware limits), the cost model's measurements and the
  // deployment-wide acceptance evidence forgotten. Requests in flight keep their own estimates;
  // new ones start from the priors. Allowed between steps.
  void ResetPolicy();
  // ---- adaptive speculation (adaptive.h; with config.measure_costs) ----
  // A decode-only step (no prefill) of `batch` requests ran `tokens` rows in `seconds`.
  void ObserveStepTime(int64_t batch, int64_t tokens, double seconds);
  // The drafter of evidence group `group` drafted `levels` tree levels in `seconds`.
  void ObserveDraftTime(int32_t group, double seconds, int64_t levels);
  // Applies the cost model's refit now (Update() does every kRefitInterval steps).
  void RefitCostModel();
  const CostModelStats& cost_model_stats() const { return cost_.stats(); }
  const StepCostModel& cost_model() const { return cost_; }
  // The deployment's acceptance average (accepted / drafted levels per speculative step, weight
  // deployment_ewma_alpha); < 0 before the first speculative step.
  double deployment_acceptance_ewma() const { return deploy_ewma_; }
  // The request's drafter failed: the engine drafts nothing more for it (its speculative entries
  // verify no draft, so its output is plain decoding's) and calibration steps do not count it.
  // Allowed mid-step. False if it has finished; throws ValueError for an unknown id.
  bool MarkDrafterFailed(int64_t id);
  // Whether the request should move to another drafter: its acceptance average with its drafter
  // (kSwitchEwmaWeight) is below `switch_below` after kSwitchMinSteps speculative steps, or it
  // started plain on its drafter's evidence. kNone for a finished request or switch_below <= 0.
  // Throws ValueError for an unknown id.
  SwitchReason GetSwitchReason(int64_t id, double switch_below) const;
  // An evidence group's decayed fallback evidence: accepted draft tokens and trials over its
  // requests' speculative steps (kDeploymentEvidenceDecay per step); a new request's prior. Zero
  // for a group without any.
  std::pair<double, double> DeploymentEvidence(int32_t evidence_group = 0) const;

  // Verifies queue/state/KV consistency; throws RuntimeError naming the first violation. For tests.
  void CheckInvariants() const;

 private:
  struct Scheduled {
    StepKind kind;
    int64_t count;  // prefill: chunk tokens; decode: draft budget
  };

  Request& Get(int64_t id, const char* what);
  // Admits a waiting request (BlockManager::AddRequest). Returns false if the pool is full.
  bool Admit(Request& r);
  // Reserve with preemption of newer unscheduled running requests. Returns false if `r` itself
  // was preempted or finished with ERROR.
  bool ReserveOrPreempt(Request& r, int64_t extra);
  void Preempt(Request& r);
  void FinishAndFree(Request& r, FinishReason reason, std::string message = std::string());
  void RemoveFromRunning(int64_t id);
  void RemoveFromWaiting(int64_t id);
  RequestState RunningStateFor(const Request& r) const;
  // Moves a request whose prompt is computed to RUNNING (speculative or plain, see the .cc).
  void StartRunning(Request& r);
  void ApplyDecode(Request& r, const StepResult::Entry& e, RequestOutput& out);
  // A calibration step (adaptive.h): the step's speculative entries decode plainly.
  void Calibrate(ScheduleOutput& out);
  void Emit(ScheduleOutput& out, Request& r, StepKind kind, const std::vector<int32_t>& toks,
            int64_t budget, int64_t num_slots);

  SchedulerConfig config_;
  SchedulerConfig initial_config_;  // as constructed (ResetPolicy)
  std::unique_ptr<BlockManager> bm_;
  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;
  std::deque<int64_t> waiting_;   // WAITING and PREEMPTED, front first
  std::vector<int64_t> running_;  // PREFILL and RUNNING_*, in admission order
  std::vector<int64_t> finished_;  // FINISHED, not yet released, in finishing order
  std::unordered_map<int64_t, Scheduled> in_flight_set_;  // scheduled by the last Step()
  std::unordered_set<int64_t> aborted_in_flight_;  // aborted between Step() and Update()
  std::vector<int64_t> step_preempted_;
  bool in_flight_ = false;
  bool skipped_prefill_chunks_ = false;  // the last step left prefilling requests' chunks out
  std::vector<int64_t> pending_finished_;  // reported by the next Step()
  std::vector<int64_t> pending_freed_;
  int64_t next_arrival_ = 0;
  std::unordered_map<int32_t, std::pair<double, double>> deploy_fb_;  // group -> (hits, trials)
  StepCostModel cost_;
  int64_t adaptive_steps_ = 0;  // steps that ran (the refit's clock)
  double deploy_ewma_ = -1.0;
  int64_t num_steps_ = 0;
  int64_t num_preemptions_ = 0;
};

}  // namespace pyspec
