#include "pyspec/request.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>

namespace pyspec {
namespace {

using S = RequestState;

// The table as the design states it, written out independently of request.cc.
std::set<std::pair<S, S>> ExpectedLegal() {
  return {
      {S::kWaiting, S::kPrefill},
      {S::kWaiting, S::kRunningSpeculative},
      {S::kWaiting, S::kRunningPlain},
      {S::kWaiting, S::kFinished},
      {S::kPrefill, S::kRunningSpeculative},
      {S::kPrefill, S::kRunningPlain},
      {S::kPrefill, S::kPreempted},
      {S::kPrefill, S::kFinished},
      {S::kRunningSpeculative, S::kRunningPlain},
      {S::kRunningSpeculative, S::kPreempted},
      {S::kRunningSpeculative, S::kFinished},
      {S::kRunningPlain, S::kRunningSpeculative},
      {S::kRunningPlain, S::kPreempted},
      {S::kRunningPlain, S::kFinished},
      {S::kPreempted, S::kPrefill},
      {S::kPreempted, S::kRunningSpeculative},
      {S::kPreempted, S::kRunningPlain},
      {S::kPreempted, S::kFinished},
  };
}

TEST(Request, TransitionTableMatchesDesign) {
  auto legal = ExpectedLegal();
  for (int f = 0; f < kNumRequestStates; ++f) {
    for (int t = 0; t < kNumRequestStates; ++t) {
      S from = static_cast<S>(f), to = static_cast<S>(t);
      EXPECT_EQ(IsLegalTransition(from, to), legal.count({from, to}) == 1)
          << RequestStateName(from) << " -> " << RequestStateName(to);
    }
  }
  EXPECT_FALSE(IsLegalTransition(static_cast<S>(17), S::kWaiting));
}

TEST(Request, Names) {
  EXPECT_STREQ(RequestStateName(S::kWaiting), "WAITING");
  EXPECT_STREQ(RequestStateName(S::kRunningSpeculative), "RUNNING_SPECULATIVE");
  EXPECT_STREQ(RequestStateName(S::kPreempted), "PREEMPTED");
  EXPECT_STREQ(FinishReasonName(FinishReason::kStop), "stop");
  EXPECT_STREQ(FinishReasonName(FinishReason::kError), "error");
}

TEST(Request, LifecycleAndHistory) {
  Request r(7, {1, 2, 3}, SamplingParams{}, 0, /*record_transitions=*/true);
  EXPECT_EQ(r.state(), S::kWaiting);
  EXPECT_EQ(r.num_tokens(), 3);
  EXPECT_EQ(r.last_token(), 3);
  r.TransitionTo(S::kPrefill);
  r.TransitionTo(S::kRunningSpeculative);
  r.generated = {9, 8};
  EXPECT_EQ(r.last_token(), 8);
  EXPECT_EQ(r.AllTokens(), (std::vector<int32_t>{1, 2, 3, 9, 8}));
  r.TransitionTo(S::kRunningPlain);
  r.TransitionTo(S::kPreempted);
  r.TransitionTo(S::kPrefill);
  r.Finish(FinishReason::kError, "too long");
  EXPECT_TRUE(r.finished());
  EXPECT_EQ(r.finish_reason(), FinishReason::kError);
  EXPECT_EQ(r.error(), "too long");
  std::vector<S> want = {S::kWaiting, S::kPrefill, S::kRunningSpeculative, S::kRunningPlain,
                         S::kPreempted, S::kPrefill, S::kFinished};
  EXPECT_EQ(r.history, want);
}

TEST(RequestDeathTest, IllegalTransitionAborts) {
  EXPECT_DEATH(
      {
        Request r(1, {1}, SamplingParams{}, 0, false);
        r.TransitionTo(S::kPreempted);  // WAITING -> PREEMPTED is not in the table
      },
      "illegal transition WAITING -> PREEMPTED");
  EXPECT_DEATH(
      {
        Request r(1, {1}, SamplingParams{}, 0, false);
        r.Finish(FinishReason::kAbort);
        r.TransitionTo(S::kWaiting);
      },
      "illegal transition FINISHED -> WAITING");
  EXPECT_DEATH(
      {
        Request r(1, {1}, SamplingParams{}, 0, false);
        r.TransitionTo(S::kPrefill);
        r.TransitionTo(S::kPrefill);  // self-transition
      },
      "request.cc");
}

}  // namespace
}  // namespace pyspec
