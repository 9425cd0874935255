#include "pyspec/request.h"

#include <utility>

#include "pyspec/check.h"

namespace pyspec {
namespace {

constexpr bool T = true;
constexpr bool F = false;
// kLegal[from][to]. Rows/columns: WAITING, PREFILL, RUNNING_SPECULATIVE, RUNNING_PLAIN,
// PREEMPTED, FINISHED.
//   WAITING   -> PREFILL; RUNNING_* when the prefix cache covers the prompt (or it is 1 token);
//                FINISHED (abort; error when it cannot fit even alone).
//   PREFILL   -> RUNNING_* after the last chunk; PREEMPTED; FINISHED (abort / error).
//   RUNNING_* -> the other RUNNING_* (adaptive fallback / probe); PREEMPTED; FINISHED.
//   PREEMPTED -> like WAITING (it is re-admitted by recompute).
//   FINISHED  -> nothing.
constexpr bool kLegal[kNumRequestStates][kNumRequestStates] = {
    /* WAITING   */ {F, T, T, T, F, T},
    /* PREFILL   */ {F, F, T, T, T, T},
    /* SPEC      */ {F, F, F, T, T, T},
    /* PLAIN     */ {F, F, T, F, T, T},
    /* PREEMPTED */ {F, T, T, T, F, T},
    /* FINISHED  */ {F, F, F, F, F, F},
};

}  // namespace

const char* RequestStateName(RequestState s) {
  switch (s) {
    case RequestState::kWaiting: return "WAITING";
    case RequestState::kPrefill: return "PREFILL";
    case RequestState::kRunningSpeculative: return "RUNNING_SPECULATIVE";
    case RequestState::kRunningPlain: return "RUNNING_PLAIN";
    case RequestState::kPreempted: return "PREEMPTED";
    case RequestState::kFinished: return "FINISHED";
  }
  return "?";
}

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "?";
}

bool IsLegalTransition(RequestState from, RequestState to) {
  int f = static_cast<int>(from), t = static_cast<int>(to);
  if (f < 0 || f >= kNumRequestStates || t < 0 || t >= kNumRequestStates) return false;
  return kLegal[f][t];
}

Request::Request(int64_t id_, std::vector<int32_t> prompt_, SamplingParams params_,
                 int64_t arrival_, bool record_transitions)
    : id(id_),
      prompt(std::move(prompt_)),
      params(std::move(params_)),
      arrival(arrival_),
      record_transitions_(record_transitions) {
  if (record_transitions_) history.push_back(state_);
}

std::vector<int32_t> Request::AllTokens() const {
  std::vector<int32_t> out;
  out.reserve(prompt.size() + generated.size());
  out.insert(out.end(), prompt.begin(), prompt.end());
  out.insert(out.end(), generated.begin(), generated.end());
  return out;
}

void Request::TransitionTo(RequestState to) {
  PYSPEC_ICHECK(IsLegalTransition(state_, to), "request ", id, ": illegal transition ",
                RequestStateName(state_), " -> ", RequestStateName(to));
  state_ = to;
  if (record_transitions_) history.push_back(to);
}

void Request::Finish(FinishReason reason, std::string message) {
  PYSPEC_ICHECK(reason != FinishReason::kNone, "request ", id, ": finish without a reason");
  TransitionTo(RequestState::kFinished);
  finish_reason_ = reason;
  error_ = std::move(message);
}

}  // namespace pyspec
