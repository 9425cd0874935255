// Request state machine (DESIGN section 2, "Request state machine").
//
//   WAITING -> PREFILL (chunked) -> RUNNING_SPECULATIVE <-> RUNNING_PLAIN -> FINISHED
//                 ^                        |                     |
//                 +------ PREEMPTED <------+---------------------+
//
// FINISHED carries a FinishReason (STOP | LENGTH | ABORT | ERROR). PREEMPTED means the request's KV
// was released (pool exhausted) and it sits at the front of the waiting queue; it is re-prefilled
// by recompute over prompt + generated tokens. Every change of state goes through
// Request::TransitionTo(), which checks the pair against the explicit table in request.cc; an
// illegal transition is a scheduler bug and aborts (PYSPEC_ICHECK) with file:line.
//
// Token convention (same as BlockManager and tests/python/reference.py): a request with T known
// tokens (prompt + generated) has the KV of positions [0, T-1) in its pages once it is running;
// token T-1 is the root of the next decode/speculative step. Prefill therefore computes positions
// [num_computed, T-1) and never samples: the first generated token comes from the first decode step
// (which may already speculate).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pyspec {

enum class RequestState : uint8_t {
  kWaiting = 0,
  kPrefill = 1,
  kRunningSpeculative = 2,
  kRunningPlain = 3,
  kPreempted = 4,
  kFinished = 5,
};
constexpr int kNumRequestStates = 6;

enum class FinishReason : uint8_t { kNone = 0, kStop, kLength, kAbort, kError };

const char* RequestStateName(RequestState s);
const char* FinishReasonName(FinishReason r);
// The transition table. Self-transitions are not transitions and are illegal.
bool IsLegalTransition(RequestState from, RequestState to);
inline bool IsRunning(RequestState s) {
  return s == RequestState::kRunningSpeculative || s == RequestState::kRunningPlain;
}

// What the scheduler needs of a request's sampling parameters.
struct SamplingParams {
  int64_t max_tokens = 16;              // >= 1 generated tokens at most
  std::vector<int32_t> stop_token_ids;  // generation stops after emitting one of these
  bool speculative = true;              // whether this request may be drafted for
  // Requests served by one drafter share an evidence group: the group's recent cost-model
  // evidence is a new request's prior (see kDeploymentEvidenceDecay). >= 0.
  int32_t evidence_group = 0;
};

// Weight of the older evidence in the cost model's fallback test, per speculative step (about
// the last twenty steps count).
inline constexpr double kFallbackEvidenceDecay = 0.95;

// The deployment's fallback evidence per evidence group (the speculative steps of every request of
// the group, i.e. of one drafter, each decayed by kDeploymentEvidenceDecay per such request-step:
// about the last hundred count) is a new request's starting evidence, scaled down to at most
// kDeploymentPriorTrials trials: a new request of a drafter that has been losing on this
// deployment's requests starts plain (when the prior alone fails the fallback test) instead of
// drafting for about twenty of its own steps, while that request's own evidence (decayed at
// kFallbackEvidenceDecay) soon outweighs the prior either way.
inline constexpr double kDeploymentEvidenceDecay = 0.99;
inline constexpr double kDeploymentPriorTrials = 20.0;

// A request whose probes keep confirming that its drafter loses waits up to this many times
// probe_interval plain steps between probes (the wait doubles per failed probe): a losing drafter
// costs a share of the steps that halves with each probe instead of staying at
// warmup_steps / probe_interval.
inline constexpr int64_t kMaxProbeBackoff = 8;

// Each time a request of an evidence group starts plain on the group's evidence, that evidence is
// scaled by this factor: with nothing but short requests (none reaching its first probe), every
// few starts one of them drafts again for its warmup_steps and refreshes the evidence, so a
// drafter that has begun to pay is not kept off for good.
inline constexpr double kPlainStartEvidenceDecay = 0.75;

// Acceptance history of a request's speculative steps.
struct AcceptanceStats {
  int64_t num_spec_steps = 0;      // steps that verified at least one draft token
  int64_t num_draft_tokens = 0;    // draft tokens (or tree nodes) verified
  int64_t num_accepted_tokens = 0;  // draft tokens accepted
  // accepted_at[i]: spec steps whose accepted path reached draft depth i + 1.
  std::vector<int64_t> accepted_at;
  // EWMA of the per-step acceptance rate accepted / drafted; < 0 until the first observation.
  double ewma = -1.0;
  // Cost model: EWMAs of accepted draft tokens and of trials per step (truncated geometric).
  double alpha_num = 0.0;
  double alpha_den = 0.0;
  // Cost-model fallback test: accepted draft tokens and trials, each decayed by
  // kFallbackEvidenceDecay per speculative step. Kept across a fallback, so a probe adds to the
  // evidence that caused it instead of starting over.
  double fb_hits = 0.0;
  double fb_trials = 0.0;
  int64_t num_fallbacks = 0;       // RUNNING_SPECULATIVE -> RUNNING_PLAIN, low acceptance
  int64_t num_cost_fallbacks = 0;  // ... because the cost model predicted no gain
  int64_t num_probes = 0;          // RUNNING_PLAIN -> RUNNING_SPECULATIVE re-probes
  // Per-token acceptance estimate; < 0 before the first speculative step.
  double TokenAcceptance() const { return alpha_den > 0 ? alpha_num / alpha_den : -1.0; }
  double AcceptanceRate() const {
    return num_draft_tokens == 0 ? 0.0
                                 : static_cast<double>(num_accepted_tokens) /
                                       static_cast<double>(num_draft_tokens);
  }
};

// A draft source (a combined drafter's part, `ngram|HEAD`: prompt lookup when the context repeats,
// the head otherwise; within prompt lookup, the length of the match it copies after) drafts some
// steps of a request, another source others, with acceptance rates far apart.
// The scheduler keeps one acceptance estimate and draft length per source and uses the one of the
// source that will draft the step (Scheduler::SetDraftSource); this holds a source's while
// another is active.
struct DraftSourceEstimate {
  double ewma = -1.0;
  double alpha_num = 0.0;
  double alpha_den = 0.0;
  int64_t draft_len = 0;  // 0: never active (starts at initial_draft_tokens)
};

// Drafter switching (SchedulerConfig::switch_below): a short acceptance average of the request's
// steps with its current drafter, weight kSwitchEwmaWeight per speculative step (about the last
// nine steps), judged after kSwitchMinSteps such steps.
inline constexpr double kSwitchEwmaWeight = 0.2;
inline constexpr int64_t kSwitchMinSteps = 4;

// Draft sources a request can have (Scheduler::SetDraftSource).
inline constexpr int32_t kMaxDraftSources = 16;

struct Request {
  Request(int64_t id, std::vector<int32_t> prompt, SamplingParams params, int64_t arrival,
          bool record_transitions);

  int64_t id;
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;
  SamplingParams params;
  int64_t arrival;  // order of AddRequest (FCFS)

  RequestState state() const { return state_; }
  FinishReason finish_reason() const { return finish_reason_; }
  const std::string& error() const { return error_; }
  bool finished() const { return state_ == RequestState::kFinished; }
  int64_t num_tokens() const {
    return static_cast<int64_t>(prompt.size() + generated.size());
  }
  int64_t num_generated() const { return static_cast<int64_t>(generated.size()); }
  int32_t last_token() const { return generated.empty() ? prompt.back() : generated.back(); }
  std::vector<int32_t> AllTokens() const;

  // Moves to `to`; PYSPEC_ICHECK that the transition is in the table.
  void TransitionTo(RequestState to);
  // TransitionTo(kFinished) and records the reason (and a message for ERROR).
  void Finish(FinishReason reason, std::string message = std::string());

  // ---- scheduler bookkeeping ----
  int64_t num_computed = 0;       // positions whose KV is in the pages (mirrors the BlockManager)
  int64_t num_decode_steps = 0;   // decode/speculative steps applied
  int64_t num_preemptions = 0;
  int64_t num_cached_tokens = 0;  // prompt tokens served by the prefix cache (last admission)
  // Draft state: the request's own draft length (grown/shrunk by acceptance); the per-step budget
  // is min(draft_len, batch-aware share, room left).
  int64_t draft_len = 0;
  // Steps decoded since the last SPECULATIVE<->PLAIN switch (drives fallback and probing).
  int64_t steps_since_switch = 0;
  // Plain steps before the next probe; 0 until the first fallback. A probe that falls back again
  // after fewer than probe_interval steps that drafted doubles it (up to kMaxProbeBackoff times
  // probe_interval); a speculative run that drafted probe_interval steps or more resets it.
  int64_t probe_wait = 0;
  // stats.num_spec_steps when the request last switched SPECULATIVE<->PLAIN (the steps that drafted
  // since, whatever the budget of the others).
  int64_t spec_steps_at_switch = 0;
  // Preempted while RUNNING_PLAIN: it resumes plain, its wait for the next probe going on.
  bool resume_plain = false;
  // Drafter switching evidence since the current drafter took over (ResetAcceptance): the
  // acceptance average (kSwitchEwmaWeight; < 0 before a speculative step) and the steps.
  double switch_ewma = -1.0;
  int64_t switch_steps = 0;
  // Its drafter failed (Scheduler::MarkDrafterFailed): the engine drafts nothing more for it and
  // a calibration step leaves its entries alone (it holds no draft back).
  bool drafter_failed = false;
  AcceptanceStats stats;
  // The draft source of the next steps; stats.ewma / alpha_* and draft_len are its estimate, the
  // others' wait in saved_sources[source] (grown on demand).
  int32_t draft_source = 0;
  std::vector<DraftSourceEstimate> saved_sources;
  // Every state visited, in order (only when the scheduler records transitions; for tests).
  std::vector<RequestState> history;

 private:
  RequestState state_ = RequestState::kWaiting;
  FinishReason finish_reason_ = FinishReason::kNone;
  std::string error_;
  bool record_transitions_;
};

}  // namespace pyspec
