#include "pyspec/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "pyspec/check.h"

namespace pyspec {
namespace {

using S = RequestState;
constexpr int32_t kVocab = 111;

// Deterministic fake model: the token at position p of a request depends only on its prompt and p,
// so a request's output does not depend on batching, chunking, acceptance or preemption.
int32_t ModelToken(const std::vector<int32_t>& prompt, int64_t p) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (int32_t t : prompt) h = (h ^ static_cast<uint64_t>(t)) * 0x100000001b3ull;
  h ^= static_cast<uint64_t>(p) * 0xbf58476d1ce4e5b9ull;
  h ^= h >> 31;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 29;
  return static_cast<int32_t>(h % kVocab);
}

// What the request generates when run alone.
std::vector<int32_t> Expected(const std::vector<int32_t>& prompt, const SamplingParams& sp) {
  std::vector<int32_t> out;
  while (static_cast<int64_t>(out.size()) < sp.max_tokens) {
    int32_t t = ModelToken(prompt, static_cast<int64_t>(prompt.size() + out.size()));
    out.push_back(t);
    if (std::count(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), t)) break;
  }
  return out;
}

std::vector<int32_t> Prompt(std::mt19937_64& rng, int n) {
  std::vector<int32_t> p(n);
  for (auto& t : p) t = static_cast<int32_t>(rng() % kVocab);
  return p;
}

// Runs `out` on the fake model. Random acceptance (drafted in [0, budget], accepted in
// [0, drafted]) unless `accept_all`; prefill chunks sometimes only partly computed. Checks the
// batch against the scheduler's view of every request.
StepResult RunFake(const Scheduler& s, const ScheduleOutput& out, std::mt19937_64* rng,
                   bool partial_prefill = false) {
  StepResult res;
  std::set<int64_t> ids, slots;
  for (int64_t i = 0; i < out.size(); ++i) {
    int64_t id = out.ids[i];
    EXPECT_TRUE(ids.insert(id).second) << "request " << id << " scheduled twice";
    const Request& r = s.GetRequest(id);
    if (r.finished()) {  // aborted between Step and Update: its entry must be ignored
      EXPECT_EQ(r.finish_reason(), FinishReason::kAbort);
      if (out.kinds[i] == StepKind::kPrefill) {
        res.AddPrefill(id, 1);
      } else {
        res.AddDecode(id, {0}, 0, 0);
      }
      continue;
    }
    std::vector<int32_t> all = r.AllTokens();
    std::vector<int32_t> toks = out.TokensOf(i);
    int64_t start = out.start_pos[i];
    EXPECT_EQ(start, r.num_computed);
    EXPECT_EQ(out.BlockTableOf(i), s.block_manager().BlockTable(id));
    for (int64_t slot : out.SlotsOf(i)) EXPECT_TRUE(slots.insert(slot).second) << "slot reused";
    if (out.kinds[i] == StepKind::kPrefill) {
      EXPECT_EQ(r.state(), S::kPrefill);
      EXPECT_EQ(out.draft_budget[i], 0);
      EXPECT_EQ(out.logits[i], LogitsKind::kNone);
      EXPECT_EQ(out.SlotsOf(i).size(), toks.size());
      for (size_t j = 0; j < toks.size(); ++j) EXPECT_EQ(toks[j], all[start + j]);
      EXPECT_LE(start + static_cast<int64_t>(toks.size()), r.num_tokens() - 1);
      int64_t n = static_cast<int64_t>(toks.size());
      if (partial_prefill && (*rng)() % 4 == 0) n = static_cast<int64_t>((*rng)() % (n + 1));
      res.AddPrefill(id, n);
    } else {
      EXPECT_TRUE(IsRunning(r.state()));
      EXPECT_EQ(toks.size(), 1u);
      EXPECT_EQ(toks[0], r.last_token());
      EXPECT_EQ(start, r.num_tokens() - 1);
      int64_t b = out.draft_budget[i];
      EXPECT_EQ(out.kinds[i] == StepKind::kSpeculative, b > 0);
      EXPECT_EQ(out.SlotsOf(i).size(), static_cast<size_t>(1 + b));
      int64_t drafted = rng ? static_cast<int64_t>((*rng)() % (b + 1)) : b;
      int64_t acc = rng ? static_cast<int64_t>((*rng)() % (drafted + 1)) : drafted;
      std::vector<int32_t> emitted;
      for (int64_t j = 0; j <= acc; ++j) emitted.push_back(ModelToken(r.prompt, start + 1 + j));
      res.AddDecode(id, emitted, drafted, acc);
    }
  }
  EXPECT_LE(out.num_budgeted_tokens(), s.config().max_num_batched_tokens);
  EXPECT_LE(out.size(), s.config().max_num_seqs);
  return res;
}

// Steps until nothing is unfinished; returns the number of steps.
int64_t Drain(Scheduler& s, std::mt19937_64* rng, int64_t max_steps = 100000) {
  int64_t steps = 0;
  while (s.has_unfinished()) {
    EXPECT_LT(steps, max_steps) << "scheduler does not terminate";
    if (steps >= max_steps) break;
    ScheduleOutput out = s.Step();
    s.Update(RunFake(s, out, rng));
    s.CheckInvariants();
    ++steps;
  }
  return steps;
}

SchedulerConfig SmallConfig() {
  SchedulerConfig c;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 8;
  c.max_draft_tokens = 4;
  c.initial_draft_tokens = 2;
  c.spec_token_budget = 16;
  c.spec_disable_batch_size = 6;
  c.record_transitions = true;
  return c;
}

TEST(Scheduler, ConfigAndArgumentValidation) {
  SchedulerConfig c;
  c.max_num_batched_tokens = 0;
  EXPECT_THROW(Scheduler(c, 8, 4), ValueError);
  c = SchedulerConfig();
  c.spec_token_budget = -1;
  EXPECT_THROW(Scheduler(c, 8, 4), ValueError);
  c = SchedulerConfig();
  c.initial_draft_tokens = 9;
  EXPECT_THROW(Scheduler(c, 8, 4), ValueError);
  c = SchedulerConfig();
  c.ewma_alpha = 0.0;
  EXPECT_THROW(Scheduler(c, 8, 4), ValueError);
  EXPECT_THROW(Scheduler(SchedulerConfig(), 0, 4), ValueError);

  Scheduler s(SchedulerConfig(), 8, 4);
  EXPECT_THROW(s.AddRequest(1, {}, SamplingParams{}), ValueError);
  SamplingParams bad;
  bad.max_tokens = 0;
  EXPECT_THROW(s.AddRequest(1, {1}, bad), ValueError);
  s.AddRequest(1, {1, 2}, SamplingParams{});
  EXPECT_THROW(s.AddRequest(1, {1, 2}, SamplingParams{}), ValueError);
  EXPECT_THROW(s.Abort(99), ValueError);
  EXPECT_THROW(s.GetRequest(99), ValueError);
  EXPECT_THROW(s.Release(1), ValueError);  // not finished
  EXPECT_THROW(s.Update(StepResult{}), ValueError);  // no step in flight
  s.Step();
  EXPECT_THROW(s.Step(), ValueError);  // not updated
  StepResult r;
  r.AddDecode(42, {1}, 0, 0);
  EXPECT_THROW(s.Update(r), ValueError);  // not scheduled
  s.CheckInvariants();
}

TEST(Scheduler, UpdateRejectsMismatchedResultsAndChangesNothing) {
  SchedulerConfig c = SmallConfig();
  Scheduler s(c, 32, 4);
  s.AddRequest(1, {5, 6, 7, 8, 9}, SamplingParams{});
  s.AddRequest(2, {3}, SamplingParams{});
  ScheduleOutput out = s.Step();
  ASSERT_EQ(out.size(), 2);
  EXPECT_EQ(out.kinds[0], StepKind::kPrefill);
  EXPECT_EQ(out.kinds[1], StepKind::kDecode);  // 1-token prompt: decode right away
  StepResult bad;
  bad.AddPrefill(1, 5);  // chunk is 4 tokens
  EXPECT_THROW(s.Update(bad), ValueError);
  StepResult bad2;
  bad2.AddDecode(2, {1, 2}, 1, 1);  // budget 0: at most 1 token
  EXPECT_THROW(s.Update(bad2), ValueError);
  StepResult bad3;
  bad3.AddPrefill(1, 4);
  bad3.AddPrefill(1, 4);
  EXPECT_THROW(s.Update(bad3), ValueError);
  StepResult bad4;
  bad4.AddDecode(1, {1}, 0, 0);  // 1 was scheduled for prefill
  EXPECT_THROW(s.Update(bad4), ValueError);
  EXPECT_TRUE(s.step_in_flight());
  EXPECT_EQ(s.GetRequest(1).num_computed, 0);
  s.CheckInvariants();
  StepResult good;
  good.AddPrefill(1, 4);
  good.AddDecode(2, {ModelToken({3}, 1)}, 0, 0);
  auto outs = s.Update(good);
  ASSERT_EQ(outs.size(), 2u);
  EXPECT_EQ(outs[1].new_tokens.size(), 1u);
  EXPECT_EQ(s.GetRequest(1).state(), S::kRunningSpeculative);
  s.CheckInvariants();
}

TEST(Scheduler, ChunkedPrefillSplitsLongPrompt) {
  SchedulerConfig c = SmallConfig();
  c.max_num_batched_tokens = 16;
  Scheduler s(c, 64, 4);
  std::mt19937_64 rng(1);
  std::vector<int32_t> p = Prompt(rng, 50);
  s.AddRequest(1, p, SamplingParams{});
  std::vector<int64_t> chunks;
  while (s.GetRequest(1).state() != S::kRunningSpeculative) {
    ScheduleOutput out = s.Step();
    ASSERT_EQ(out.size(), 1);
    ASSERT_EQ(out.kinds[0], StepKind::kPrefill);
    EXPECT_EQ(out.start_pos[0], s.GetRequest(1).num_computed);
    chunks.push_back(out.num_scheduled_tokens());
    s.Update(RunFake(s, out, nullptr));
    s.CheckInvariants();
  }
  // 49 positions before the root: 16 + 16 + 16 + 1.
  EXPECT_EQ(chunks, (std::vector<int64_t>{16, 16, 16, 1}));
  ScheduleOutput out = s.Step();
  ASSERT_EQ(out.size(), 1);
  EXPECT_EQ(out.kinds[0], StepKind::kSpeculative);
  EXPECT_EQ(out.start_pos[0], 49);
  EXPECT_EQ(out.TokensOf(0), (std::vector<int32_t>{p.back()}));
  s.Update(RunFake(s, out, nullptr));
  Drain(s, nullptr);
  EXPECT_EQ(s.GetRequest(1).generated, Expected(p, SamplingParams{}));
  EXPECT_EQ(s.GetRequest(1).finish_reason(), FinishReason::kLength);
}

TEST(Scheduler, AShortPromptIsNotQueuedBehindALongPromptsChunks) {
  // A 40-token prompt prefills in chunks of 8; a 3-token prompt arriving meanwhile runs in the
  // next step without a chunk of the long one, and the long one's chunks go on in the step after
  // even while more short prompts arrive (at most every other step leaves them out).
  SchedulerConfig c = SmallConfig();
  c.max_num_batched_tokens = 64;
  c.max_prefill_chunk = 8;
  Scheduler s(c, 64, 4);
  std::mt19937_64 rng(3);
  SamplingParams sp;
  sp.max_tokens = 4;
  std::vector<int32_t> long_p = Prompt(rng, 40);
  s.AddRequest(1, long_p, sp);
  ScheduleOutput out = s.Step();
  ASSERT_EQ(out.size(), 1);
  EXPECT_EQ(out.num_scheduled_tokens(), 8);
  s.Update(RunFake(s, out, nullptr));
  std::vector<std::vector<int32_t>> shorts;
  for (int64_t id = 2; id <= 4; ++id) {
    shorts.push_back(Prompt(rng, 3));
    s.AddRequest(id, shorts.back(), sp);
    out = s.Step();
    std::set<int64_t> ids(out.ids.begin(), out.ids.end());
    if (id % 2 == 0) {  // a short-first step: the newcomer's prefill, no chunk of the long one
      EXPECT_TRUE(ids.count(id)) << id;
      EXPECT_FALSE(ids.count(1)) << id;
    } else {  // the next: the long prompt's chunk runs (the newcomer rides along)
      EXPECT_TRUE(ids.count(1)) << id;
    }
    s.Update(RunFake(s, out, nullptr));
    s.CheckInvariants();
  }
  Drain(s, nullptr);
  EXPECT_EQ(s.GetRequest(1).generated, Expected(long_p, sp));
  for (int64_t id = 2; id <= 4; ++id) {
    EXPECT_EQ(s.GetRequest(id).generated, Expected(shorts[id - 2], sp));
  }
  // Without a chunk limit, arrival order decides (the long prompt's remaining tokens first).
  c.max_prefill_chunk = 0;
  c.max_num_batched_tokens = 8;
  Scheduler plain(c, 64, 4);
  plain.AddRequest(1, long_p, sp);
  plain.Update(RunFake(plain, plain.Step(), nullptr));
  plain.AddRequest(2, Prompt(rng, 3), sp);
  out = plain.Step();
  ASSERT_EQ(out.size(), 1);
  EXPECT_EQ(out.ids[0], 1);
  plain.Update(RunFake(plain, out, nullptr));
  Drain(plain, nullptr);
}

TEST(Scheduler, PrefillChunksShareTheBudgetWithDecodes) {
  SchedulerConfig c = SmallConfig();
  c.max_num_batched_tokens = 10;
  c.max_draft_tokens = 0;
  c.initial_draft_tokens = 0;
  Scheduler s(c, 64, 4);
  std::mt19937_64 rng(2);
  SamplingParams sp;
  sp.max_tokens = 30;
  for (int i = 0; i < 3; ++i) s.AddRequest(i, Prompt(rng, 2), sp);
  s.AddRequest(9, Prompt(rng, 40), sp);
  ScheduleOutput out = s.Step();
  s.Update(RunFake(s, out, nullptr));
  out = s.Step();  // three decodes first (1 token each), then a 7-token chunk
  ASSERT_EQ(out.size(), 4);
  EXPECT_EQ(out.kinds[3], StepKind::kPrefill);
  EXPECT_EQ(out.TokensOf(3).size(), 7u);
  EXPECT_EQ(out.num_budgeted_tokens(), 10);
  s.Update(RunFake(s, out, nullptr));
  Drain(s, nullptr);
}

TEST(Scheduler, SpeculationBudgetShrinksToZeroAtLargeBatch) {
  SchedulerConfig c = SmallConfig();
  c.max_num_batched_tokens = 512;
  c.max_num_seqs = 64;
  c.max_draft_tokens = 4;
  c.initial_draft_tokens = 4;
  c.spec_token_budget = 12;
  c.spec_disable_batch_size = 8;
  Scheduler s(c, 1024, 4);
  EXPECT_EQ(s.SpecShare(1, 1), 4);
  EXPECT_EQ(s.SpecShare(3, 3), 4);
  EXPECT_EQ(s.SpecShare(4, 4), 3);
  EXPECT_EQ(s.SpecShare(6, 6), 2);
  EXPECT_EQ(s.SpecShare(7, 7), 1);
  EXPECT_EQ(s.SpecShare(8, 8), 0);
  EXPECT_EQ(s.SpecShare(100, 1), 0);
  for (int64_t n : {1, 4, 6, 8, 20}) {
    Scheduler t(c, 1024, 4);
    SamplingParams sp;
    sp.max_tokens = 100;
    std::mt19937_64 rng(n);
    for (int64_t i = 0; i < n; ++i) t.AddRequest(i, Prompt(rng, 3), sp);
    ScheduleOutput out = t.Step();  // prefill everybody
    t.Update(RunFake(t, out, nullptr));
    out = t.Step();
    ASSERT_EQ(out.size(), n);
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(out.draft_budget[i], t.SpecShare(n, n)) << "n=" << n;
      EXPECT_EQ(out.kinds[i], n >= 8 ? StepKind::kDecode : StepKind::kSpeculative);
      total += out.draft_budget[i];
    }
    EXPECT_LE(total, 12);
    if (n >= 8) EXPECT_EQ(total, 0);
    t.Update(RunFake(t, out, nullptr));
    t.CheckInvariants();
  }
}

TEST(Scheduler, DraftLengthAdaptsAndFallsBackToPlain) {
  SchedulerConfig c = SmallConfig();
  c.min_acceptance_rate = 0.5;
  c.warmup_steps = 3;
  c.probe_interval = 5;
  c.spec_disable_batch_size = 0;
  Scheduler s(c, 256, 4);
  std::mt19937_64 rng(3);
  std::vector<int32_t> p = Prompt(rng, 6);
  SamplingParams sp;
  sp.max_tokens = 200;
  s.AddRequest(1, p, sp);
  ScheduleOutput out = s.Step();
  s.Update(RunFake(s, out, nullptr));
  // Accept everything: draft_len grows to max_draft_tokens.
  for (int i = 0; i < 4; ++i) {
    out = s.Step();
    s.Update(RunFake(s, out, nullptr));
  }
  EXPECT_EQ(s.GetRequest(1).draft_len, 4);
  EXPECT_DOUBLE_EQ(s.GetRequest(1).stats.ewma, 1.0);
  // Reject everything: draft_len shrinks, EWMA falls, and the request falls back to PLAIN.
  int steps = 0;
  while (s.GetRequest(1).state() == S::kRunningSpeculative) {
    out = s.Step();
    ASSERT_EQ(out.size(), 1);
    const Request& r = s.GetRequest(1);
    StepResult res;
    res.AddDecode(1, {ModelToken(p, r.num_tokens())}, out.draft_budget[0], 0);
    s.Update(res);
    ASSERT_LT(++steps, 50);
  }
  EXPECT_EQ(s.GetRequest(1).state(), S::kRunningPlain);
  EXPECT_LT(s.GetRequest(1).stats.ewma, 0.5);
  EXPECT_EQ(s.GetRequest(1).draft_len, 1);
  // Plain steps have no draft budget; after probe_interval of them it speculates again.
  for (int i = 0; i < 5; ++i) {
    out = s.Step();
    EXPECT_EQ(out.kinds[0], StepKind::kDecode);
    s.Update(RunFake(s, out, nullptr));
  }
  EXPECT_EQ(s.GetRequest(1).state(), S::kRunningSpeculative);
  const Request& r = s.GetRequest(1);
  EXPECT_EQ(r.stats.accepted_at.size(), 4u);
  EXPECT_EQ(r.stats.accepted_at[0], 4);
  Drain(s, nullptr);
  EXPECT_EQ(s.GetRequest(1).generated, Expected(p, sp));
}

TEST(Scheduler, StopTokenDropsTheTailAndMaxTokensTruncates) {
  SchedulerConfig c = SmallConfig();
  Scheduler s(c, 256, 4);
  std::mt19937_64 rng(4);
  std::vector<int32_t> p = Prompt(rng, 5);
  SamplingParams sp;
  sp.max_tokens = 50;
  // The third generated token is the stop token.
  sp.stop_token_ids = {ModelToken(p, 7)};
  std::vector<int32_t> want = Expected(p, sp);
  ASSERT_LE(want.size(), 3u);
  s.AddRequest(1, p, sp);
  SamplingParams sp2;
  sp2.max_tokens = 2;
  s.AddRequest(2, p, sp2);
  ScheduleOutput out = s.Step();
  s.Update(RunFake(s, out, nullptr));
  out = s.Step();
  ASSERT_EQ(out.size(), 2);
  // Pretend the drafter proposed many correct tokens: emitted past the stop / max_tokens.
  StepResult res;
  for (int64_t i = 0; i < 2; ++i) {
    int64_t b = out.draft_budget[i];
    std::vector<int32_t> emitted;
    for (int64_t j = 0; j <= b; ++j) emitted.push_back(ModelToken(p, 5 + j));
    res.AddDecode(out.ids[i], emitted, b, b);
  }
  auto outs = s.Update(res);
  Drain(s, nullptr);
  EXPECT_EQ(s.GetRequest(1).generated, want);
  EXPECT_EQ(s.GetRequest(2).generated, Expected(p, sp2));
  EXPECT_EQ(s.GetRequest(2).finish_reason(), FinishReason::kLength);
  EXPECT_EQ(s.block_manager().num_requests(), 0);
  out = s.Step();
  s.Update(StepResult{});
  EXPECT_EQ(s.num_running(), 0);
}

TEST(Scheduler, AbortInEveryStateFreesEverything) {
  SchedulerConfig c = SmallConfig();
  c.max_num_batched_tokens = 8;
  c.min_acceptance_rate = 0.9;
  c.warmup_steps = 1;
  for (int target = 0; target < 6; ++target) {
    Scheduler s(c, 12, 4, /*enable_prefix_cache=*/false);
    std::mt19937_64 rng(target);
    SamplingParams sp;
    sp.max_tokens = 40;
    SamplingParams sp2;
    sp2.max_tokens = 40;
    s.AddRequest(2, Prompt(rng, 3), sp2);
    s.AddRequest(1, Prompt(rng, 20), sp);  // long: several chunks
    bool in_flight = false;
    auto state_of = [&]() { return s.GetRequest(1).state(); };
    for (int step = 0; step < 200 && !s.GetRequest(1).finished(); ++step) {
      S st = state_of();
      bool hit = (target == 0 && st == S::kWaiting) || (target == 1 && st == S::kPrefill) ||
                 (target == 2 && st == S::kRunningSpeculative) ||
                 (target == 3 && st == S::kRunningPlain) ||
                 (target == 4 && st == S::kPreempted);
      if (hit) break;
      ScheduleOutput out = s.Step();
      if (target == 5 && !out.empty() && out.ids[0] == 1 &&
          out.kinds[0] != StepKind::kPrefill) {
        in_flight = true;  // abort between Step and Update
        EXPECT_TRUE(s.Abort(1));
        s.CheckInvariants();
        StepResult res = RunFake(s, out, &rng);
        s.Update(res);  // the aborted request's entry is ignored
        break;
      }
      // Request 1 rejects every draft (it falls back to PLAIN); request 2, older, keeps growing
      // and pre-empts request 1 when the 12-block pool runs out.
      StepResult res;
      for (int64_t i = 0; i < out.size(); ++i) {
        const Request& r = s.GetRequest(out.ids[i]);
        if (out.kinds[i] == StepKind::kPrefill) {
          res.AddPrefill(out.ids[i], out.TokensOf(i).size());
        } else {
          int64_t a = out.ids[i] == 1 ? 0 : out.draft_budget[i];
          std::vector<int32_t> emitted;
          for (int64_t j = 0; j <= a; ++j) {
            emitted.push_back(ModelToken(r.prompt, r.num_tokens() + j));
          }
          res.AddDecode(out.ids[i], emitted, out.draft_budget[i], a);
        }
      }
      s.Update(res);
      s.CheckInvariants();
    }
    if (target != 5) {
      EXPECT_EQ(RequestStateName(state_of()),
                RequestStateName(std::vector<S>{S::kWaiting, S::kPrefill, S::kRunningSpeculative,
                                                S::kRunningPlain, S::kPreempted}[target]));
      EXPECT_TRUE(s.Abort(1));
    } else {
      EXPECT_TRUE(in_flight);
    }
    EXPECT_FALSE(s.Abort(1));  // already finished
    EXPECT_EQ(s.GetRequest(1).finish_reason(), FinishReason::kAbort);
    EXPECT_FALSE(s.block_manager().HasRequest(1));
    s.CheckInvariants();
    s.Abort(2);
    EXPECT_EQ(s.block_manager().num_free_blocks(), s.block_manager().num_total_blocks());
    ScheduleOutput out = s.Step();
    EXPECT_TRUE(out.empty());
    EXPECT_TRUE(std::count(out.finished_ids.begin(), out.finished_ids.end(), 1) == 1 ||
                target == 5);
    s.Update(StepResult{});
    s.Release(1);
    EXPECT_FALSE(s.HasRequest(1));
    s.CheckInvariants();
  }
}

TEST(Scheduler, PreemptionByRecomputeKeepsOutputs) {
  SchedulerConfig c = SmallConfig();
  c.max_num_batched_tokens = 32;
  Scheduler s(c, 10, 4);  // 40 token slots
  std::mt19937_64 rng(5);
  SamplingParams sp;
  sp.max_tokens = 14;
  std::map<int64_t, std::vector<int32_t>> prompts;
  for (int64_t i = 0; i < 3; ++i) {
    prompts[i] = Prompt(rng, 8);
    s.AddRequest(i, prompts[i], sp);
  }
  int64_t preempted = 0;
  int64_t steps = 0;
  while (s.has_unfinished()) {
    ScheduleOutput out = s.Step();
    preempted += static_cast<int64_t>(out.preempted_ids.size());
    for (int64_t id : out.preempted_ids) {
      EXPECT_EQ(s.GetRequest(id).state(), S::kPreempted);
      const auto& q = s.waiting_queue();
      EXPECT_TRUE(std::count(q.begin(), q.end(), id));
      EXPECT_TRUE(std::count(out.freed_ids.begin(), out.freed_ids.end(), id));
    }
    // Preempted requests go to the front of the waiting queue: ahead of every WAITING request.
    bool seen_waiting = false;
    for (int64_t id : s.waiting_queue()) {
      S st = s.GetRequest(id).state();
      if (st == S::kWaiting) seen_waiting = true;
      EXPECT_FALSE(seen_waiting && st == S::kPreempted);
    }
    s.Update(RunFake(s, out, nullptr));
    s.CheckInvariants();
    ASSERT_LT(++steps, 1000);
  }
  EXPECT_GT(preempted, 0);
  EXPECT_EQ(s.num_preemptions(), preempted);
  for (auto& kv : prompts) {
    const Request& r = s.GetRequest(kv.first);
    EXPECT_EQ(r.finish_reason(), FinishReason::kLength);
    EXPECT_EQ(r.generated, Expected(kv.second, sp));
  }
}

TEST(Scheduler, TooLongRequestEndsWithError) {
  SchedulerConfig c = SmallConfig();
  Scheduler s(c, 4, 4);  // 16 token slots
  std::mt19937_64 rng(6);
  SamplingParams sp;
  sp.max_tokens = 4;
  s.AddRequest(1, Prompt(rng, 20), sp);  // prompt alone does not fit
  std::vector<int32_t> p2 = Prompt(rng, 10);
  SamplingParams long_sp;
  long_sp.max_tokens = 30;  // fits at first, outgrows the pool while decoding
  s.AddRequest(2, p2, long_sp);
  std::vector<int32_t> p3 = Prompt(rng, 5);
  s.AddRequest(3, p3, sp);
  Drain(s, &rng);
  EXPECT_EQ(s.GetRequest(1).finish_reason(), FinishReason::kError);
  EXPECT_NE(s.GetRequest(1).error().find("even alone"), std::string::npos);
  EXPECT_TRUE(s.GetRequest(1).generated.empty());
  const Request& r2 = s.GetRequest(2);
  EXPECT_EQ(r2.finish_reason(), FinishReason::kError);
  std::vector<int32_t> full = Expected(p2, long_sp);
  EXPECT_GT(r2.generated.size(), 0u);
  EXPECT_LT(r2.generated.size(), full.size());
  EXPECT_TRUE(std::equal(r2.generated.begin(), r2.generated.end(), full.begin()));
  EXPECT_EQ(s.GetRequest(3).generated, Expected(p3, sp));
  EXPECT_EQ(s.block_manager().num_requests(), 0);
}

TEST(Scheduler, PrefixCacheHitSkipsComputedTokens) {
  SchedulerConfig c = SmallConfig();
  Scheduler s(c, 64, 4);
  std::mt19937_64 rng(7);
  std::vector<int32_t> p = Prompt(rng, 18);
  SamplingParams sp;
  sp.max_tokens = 3;
  s.AddRequest(1, p, sp);
  Drain(s, nullptr);
  s.AddRequest(2, p, sp);
  ScheduleOutput out = s.Step();
  ASSERT_EQ(out.size(), 1);
  EXPECT_EQ(s.GetRequest(2).num_cached_tokens, 16);
  EXPECT_EQ(out.start_pos[0], 16);
  EXPECT_EQ(out.TokensOf(0).size(), 1u);  // only position 16; 17 is the root
  s.Update(RunFake(s, out, nullptr));
  Drain(s, nullptr);
  EXPECT_EQ(s.GetRequest(2).generated, s.GetRequest(1).generated);
}

// Random event sequences; invariants after every event; final outputs equal the solo outputs.
TEST(Scheduler, RandomEventSequences) {
  const std::set<std::pair<S, S>> legal = [] {
    std::set<std::pair<S, S>> l;
    for (int f = 0; f < kNumRequestStates; ++f)
      for (int t = 0; t < kNumRequestStates; ++t)
        if (IsLegalTransition(static_cast<S>(f), static_cast<S>(t)))
          l.insert({static_cast<S>(f), static_cast<S>(t)});
    return l;
  }();
  int64_t total_events = 0, total_preemptions = 0, total_errors = 0, total_spec = 0;
  for (uint64_t seed = 0; seed < 24; ++seed) {
    std::mt19937_64 rng(seed);
    SchedulerConfig c;
    c.max_num_batched_tokens = 8 + static_cast<int64_t>(rng() % 40);
    c.max_num_seqs = 1 + static_cast<int64_t>(rng() % 8);
    c.max_prefill_chunk = static_cast<int64_t>(rng() % 3) * 5;
    c.max_draft_tokens = static_cast<int64_t>(rng() % 6);
    c.initial_draft_tokens = c.max_draft_tokens == 0 ? 0 : 1 + rng() % c.max_draft_tokens;
    c.spec_token_budget = static_cast<int64_t>(rng() % 20);
    c.spec_disable_batch_size = static_cast<int64_t>(rng() % 6);
    c.min_acceptance_rate = (rng() % 2) * 0.3;
    c.warmup_steps = 2;
    c.probe_interval = 3;
    c.record_transitions = true;
    // Odd seeds with the cost model at a cost that loses (starts plain on evidence, backoff,
    // preemptions of plain requests); even seeds as before (the same draws from rng).
    c.cost_model = seed % 2 == 1;
    c.draft_cost = 0.3;
    const int block_size = 1 + static_cast<int>(rng() % 5);
    const int64_t num_blocks = 4 + static_cast<int64_t>(rng() % 30);
    Scheduler s(c, num_blocks, block_size, rng() % 4 != 0);
    std::map<int64_t, std::pair<std::vector<int32_t>, SamplingParams>> reqs;
    std::vector<std::vector<int32_t>> shared_prompts;
    int64_t next_id = 0;
    ScheduleOutput pending;
    bool in_flight = false;
    for (int ev = 0; ev < 2500; ++ev) {
      uint64_t kind = rng() % 100;
      if (kind < 12) {  // add
        std::vector<int32_t> p;
        if (!shared_prompts.empty() && rng() % 3 == 0) {
          p = shared_prompts[rng() % shared_prompts.size()];  // prefix-cache hits
        } else {
          p = Prompt(rng, 1 + static_cast<int>(rng() % 24));
          shared_prompts.push_back(p);
        }
        SamplingParams sp;
        sp.max_tokens = 1 + static_cast<int64_t>(rng() % 20);
        if (rng() % 3 == 0) sp.stop_token_ids = {static_cast<int32_t>(rng() % kVocab)};
        sp.speculative = rng() % 4 != 0;
        s.AddRequest(next_id, p, sp);
        reqs[next_id++] = {p, sp};
      } else if (kind < 16 && !reqs.empty()) {  // abort a random request (any state)
        auto it = reqs.begin();
        std::advance(it, rng() % reqs.size());
        if (s.HasRequest(it->first)) {
          bool was_finished = s.GetRequest(it->first).finished();
          EXPECT_EQ(s.Abort(it->first), !was_finished);
          EXPECT_FALSE(s.block_manager().HasRequest(it->first));
        }
      } else if (kind < 18 && !s.finished_ids().empty()) {  // release a finished request
        std::vector<int64_t> f = s.finished_ids();
        int64_t id = f[rng() % f.size()];
        const Request& r = s.GetRequest(id);
        // Check its final tokens before forgetting it.
        const auto& [p, sp] = reqs.at(id);
        std::vector<int32_t> want = Expected(p, sp);
        FinishReason why = r.finish_reason();
        if (why == FinishReason::kStop || why == FinishReason::kLength) {
          EXPECT_EQ(r.generated, want) << "seed " << seed << " request " << id;
        } else {
          ASSERT_LE(r.generated.size(), want.size());
          EXPECT_TRUE(std::equal(r.generated.begin(), r.generated.end(), want.begin()));
        }
        for (size_t i = 1; i < r.history.size(); ++i) {
          EXPECT_TRUE(legal.count({r.history[i - 1], r.history[i]}));
        }
        s.Release(id);
        reqs.erase(id);
      } else if (!in_flight) {  // step
        pending = s.Step();
        in_flight = true;
        total_preemptions += static_cast<int64_t>(pending.preempted_ids.size());
        for (int64_t b : pending.draft_budget) total_spec += b > 0;
        EXPECT_LE(pending.num_budgeted_tokens(), c.max_num_batched_tokens);
      } else {  // update
        s.Update(RunFake(s, pending, &rng, /*partial_prefill=*/true));
        in_flight = false;
      }
      ++total_events;
      s.CheckInvariants();
      for (const auto& kv : reqs) {
        if (!s.HasRequest(kv.first)) continue;
        const Request& r = s.GetRequest(kv.first);
        EXPECT_LE(r.num_generated(), kv.second.second.max_tokens);
        if (r.finished()) EXPECT_FALSE(s.block_manager().HasRequest(kv.first));
      }
    }
    if (in_flight) s.Update(RunFake(s, pending, &rng));
    Drain(s, &rng);
    for (const auto& kv : reqs) {
      const Request& r = s.GetRequest(kv.first);
      ASSERT_TRUE(r.finished());
      std::vector<int32_t> want = Expected(kv.second.first, kv.second.second);
      const int64_t need_blocks =
          (static_cast<int64_t>(kv.second.first.size()) + kv.second.second.max_tokens +
           block_size - 1) / block_size;
      if (r.finish_reason() == FinishReason::kError) {
        ++total_errors;
        EXPECT_GT(need_blocks, num_blocks) << "request " << kv.first << " fits but erred: "
                                           << r.error();
      }
      if (r.finish_reason() == FinishReason::kStop || r.finish_reason() == FinishReason::kLength) {
        EXPECT_EQ(r.generated, want) << "seed " << seed << " request " << kv.first;
      } else {
        ASSERT_LE(r.generated.size(), want.size());
        EXPECT_TRUE(std::equal(r.generated.begin(), r.generated.end(), want.begin()));
      }
      for (size_t i = 1; i < r.history.size(); ++i) {
        EXPECT_TRUE(legal.count({r.history[i - 1], r.history[i]}))
            << RequestStateName(r.history[i - 1]) << " -> " << RequestStateName(r.history[i]);
      }
      EXPECT_EQ(r.history.back(), S::kFinished);
    }
    EXPECT_EQ(s.block_manager().num_requests(), 0);
  }
  // The sequences must actually exercise preemption, errors and speculation.
  EXPECT_GT(total_preemptions, 0);
  EXPECT_GT(total_errors, 0);
  EXPECT_GT(total_spec, 0);
  EXPECT_EQ(total_events, 24 * 2500);
}

}  // namespace
}  // namespace pyspec

// ---- Cost model (Leviathan et al. 2023) ----

namespace {
double Rate(double a, double c, int g) {
  double e = 0.0;
  for (int i = 0; i <= g; ++i) e += std::pow(a, i);
  return e / (1.0 + c * g);
}
}  // namespace

TEST(CostModel, MatchesBruteForceOptimum) {
  for (double a : {0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0}) {
    for (double c : {0.0, 0.01, 0.05, 0.2, 0.5, 1.0}) {
      for (int64_t max_len : {1, 4, 8, 32}) {
        double gain = 0.0;
        int64_t g = pyspec::OptimalDraftLength(a, c * 0.5, c * 0.5, max_len, &gain);
        ASSERT_GE(g, 1);
        ASSERT_LE(g, max_len);
        double best = 0.0;
        for (int k = 1; k <= max_len; ++k) best = std::max(best, Rate(a, c, k));
        EXPECT_NEAR(gain, best, 1e-9) << a << " " << c << " " << max_len;
        EXPECT_NEAR(Rate(a, c, static_cast<int>(g)), best, 1e-9);
      }
    }
  }
  // Monotone in alpha: better drafts never get shorter optimal drafts.
  int64_t prev = 1;
  for (double a = 0.0; a <= 1.0; a += 0.01) {
    int64_t g = pyspec::OptimalDraftLength(a, 0.02, 0.02, 16);
    EXPECT_GE(g, prev);
    prev = g;
  }
  double gain = 0.0;
  pyspec::OptimalDraftLength(0.05, 0.3, 0.2, 8, &gain);
  EXPECT_LT(gain, 1.0);  // poor acceptance and a costly drafter: plain decoding wins
  EXPECT_THROW(pyspec::OptimalDraftLength(0.5, -1.0, 0.0, 4), pyspec::ValueError);
  EXPECT_THROW(pyspec::OptimalDraftLength(0.5, 0.0, 0.0, 0), pyspec::ValueError);
  // A huge max_len is refused, not scanned (it held the interpreter for seconds to forever).
  EXPECT_THROW(pyspec::OptimalDraftLength(0.5, 0.0, 0.0, pyspec::kMaxOptimalDraftLength + 1),
               pyspec::ValueError);
  EXPECT_GE(pyspec::OptimalDraftLength(0.999, 0.0, 0.01, pyspec::kMaxOptimalDraftLength), 1);
}

namespace {

// A cost-model scheduler config: drafts of up to `max_draft` tokens starting at `initial`, at the
// given costs relative to a plain step.
pyspec::SchedulerConfig CostModelConfig(int64_t max_draft, int64_t initial, double draft_cost,
                                        double verify_cost) {
  pyspec::SchedulerConfig c;
  c.cost_model = true;
  c.max_draft_tokens = max_draft;
  c.initial_draft_tokens = initial;
  c.draft_cost = draft_cost;
  c.verify_cost = verify_cost;
  return c;
}

// One step in which every draft token is accepted (accept_all) or none is; returns the last
// decode entry's draft budget (-1 when the step had no decode).
int64_t StepAcceptingAllOrNone(pyspec::Scheduler& s, bool accept_all) {
  auto out = s.Step();
  pyspec::StepResult res;
  int64_t budget = -1;
  for (size_t i = 0; i < out.ids.size(); ++i) {
    if (out.kinds[i] == pyspec::StepKind::kPrefill) {
      res.AddPrefill(out.ids[i], out.token_indptr[i + 1] - out.token_indptr[i]);
    } else {
      budget = out.draft_budget[i];
      int64_t a = accept_all ? budget : 0;
      res.AddDecode(out.ids[i], std::vector<int32_t>(a + 1, 5), budget, a);
    }
  }
  s.Update(res);
  return budget;
}

}  // namespace

TEST(CostModel, SchedulerAdaptsAndFallsBack) {
  pyspec::SchedulerConfig c = CostModelConfig(8, 4, 0.0, 0.01);
  c.warmup_steps = 2;
  c.probe_interval = 3;
  pyspec::Scheduler s(c, 256, 4, false);
  s.AddRequest(1, {1, 2, 3}, [] { pyspec::SamplingParams p; p.max_tokens = 200; return p; }());
  auto run_step = [&](bool accept_all) { StepAcceptingAllOrNone(s, accept_all); };
  run_step(true);  // prefill
  for (int i = 0; i < 6; ++i) run_step(true);
  EXPECT_EQ(s.GetRequest(1).draft_len, 8);  // everything accepted: the longest draft pays
  EXPECT_GT(s.GetRequest(1).stats.TokenAcceptance(), 0.99);
  s.SetCostModel(0.5, 0.1);
  // Nothing accepted from now on, and drafting is costly: after the streak of full acceptances
  // a few misses are not yet evidence enough, but the fallback comes within ten-odd steps.
  int misses = 0;
  while (s.GetRequest(1).stats.num_cost_fallbacks == 0 && misses < 100) {
    run_step(false);
    ++misses;
  }
  EXPECT_GE(misses, 4);
  EXPECT_LE(misses, 30);
  EXPECT_EQ(s.GetRequest(1).draft_len, 1);
  for (int i = 0; i < 4; ++i) run_step(false);
  const pyspec::Request& r = s.GetRequest(1);
  EXPECT_GE(r.stats.num_cost_fallbacks, 1);
  EXPECT_GE(r.stats.num_probes, 1);  // plain for probe_interval steps, then probed again
  EXPECT_THROW(s.SetCostModel(std::nan(""), 0.0), pyspec::ValueError);
}

TEST(CostModel, ResetAcceptanceGivesANewDrafterAFreshStart) {
  // A drafter that is never right drives the request to plain decoding; after
  // ResetAcceptance (another drafter takes over) it speculates at once with the initial draft
  // length, judged on new evidence only: one fully accepted step moves the estimate to 1.
  pyspec::SchedulerConfig c = CostModelConfig(8, 3, 0.3, 0.05);
  c.warmup_steps = 2;
  c.probe_interval = 50;
  pyspec::Scheduler s(c, 256, 4, false);
  s.AddRequest(1, {1, 2, 3}, [] { pyspec::SamplingParams p; p.max_tokens = 200; return p; }());
  int64_t last_budget = -1;
  auto run_step = [&](bool accept_all) { last_budget = StepAcceptingAllOrNone(s, accept_all); };
  run_step(true);  // prefill
  int steps = 0;
  while (s.GetRequest(1).state() != pyspec::RequestState::kRunningPlain && steps < 60) {
    run_step(false);
    ++steps;
  }
  ASSERT_EQ(s.GetRequest(1).state(), pyspec::RequestState::kRunningPlain);
  run_step(false);
  EXPECT_EQ(last_budget, 0);  // plain: no draft
  const int64_t spec_steps = s.GetRequest(1).stats.num_spec_steps;
  EXPECT_TRUE(s.ResetAcceptance(1));
  const pyspec::Request& r = s.GetRequest(1);
  EXPECT_EQ(r.state(), pyspec::RequestState::kRunningSpeculative);
  EXPECT_EQ(r.draft_len, 3);
  EXPECT_LT(r.stats.TokenAcceptance(), 0.0);  // no estimate yet
  EXPECT_EQ(r.stats.num_spec_steps, spec_steps);  // lifetime counters stay
  run_step(true);
  EXPECT_EQ(last_budget, 3);
  EXPECT_GT(s.GetRequest(1).stats.TokenAcceptance(), 0.99);
  EXPECT_THROW(s.ResetAcceptance(99), pyspec::ValueError);
  // In the middle of a step (after Step(), before Update()) it is refused.
  auto out = s.Step();
  EXPECT_THROW(s.ResetAcceptance(1), pyspec::ValueError);
  pyspec::StepResult res;
  res.AddDecode(1, std::vector<int32_t>(out.draft_budget[0] + 1, 5), out.draft_budget[0],
                out.draft_budget[0]);
  s.Update(res);
  EXPECT_TRUE(s.Abort(1));
  EXPECT_FALSE(s.ResetAcceptance(1));
}

TEST(CostModel, DraftSourcesKeepTheirOwnEstimates) {
  // `ngram|HEAD`: source 0 (prompt lookup) is right about every token it copies, source 1 (a
  // head) about none. Each keeps its own estimate and draft length, so the head's misses do not
  // shorten prompt lookup's drafts, and prompt lookup's hits do not lengthen the head's.
  pyspec::SchedulerConfig c = CostModelConfig(8, 3, 0.0, 0.02);
  pyspec::Scheduler s(c, 256, 4, false);
  s.AddRequest(1, {1, 2, 3}, [] { pyspec::SamplingParams p; p.max_tokens = 400; return p; }());
  int64_t last_budget = -1;
  auto run_step = [&](bool accept_all) { last_budget = StepAcceptingAllOrNone(s, accept_all); };
  run_step(true);  // prefill
  EXPECT_EQ(s.GetRequest(1).draft_source, 0);
  for (int i = 0; i < 5; ++i) run_step(true);
  EXPECT_EQ(s.GetRequest(1).draft_len, 8);
  EXPECT_TRUE(s.SetDraftSource(1, 1));  // a source never used starts fresh
  EXPECT_EQ(s.GetRequest(1).draft_len, 3);
  EXPECT_LT(s.GetRequest(1).stats.TokenAcceptance(), 0.0);
  run_step(false);
  EXPECT_EQ(last_budget, 3);
  run_step(false);
  EXPECT_LT(last_budget, 3);  // the head's own evidence shortens its drafts
  const int64_t head_len = s.GetRequest(1).draft_len;
  EXPECT_LT(s.GetRequest(1).stats.TokenAcceptance(), 0.01);
  EXPECT_TRUE(s.SetDraftSource(1, 0));  // prompt lookup's estimate is as it left it
  EXPECT_EQ(s.GetRequest(1).draft_len, 8);
  EXPECT_GT(s.GetRequest(1).stats.TokenAcceptance(), 0.99);
  run_step(true);
  EXPECT_EQ(last_budget, 8);
  EXPECT_TRUE(s.SetDraftSource(1, 1));
  EXPECT_EQ(s.GetRequest(1).draft_len, head_len);
  EXPECT_TRUE(s.SetDraftSource(1, 1));  // the same source: nothing changes
  EXPECT_EQ(s.GetRequest(1).draft_len, head_len);
  // Lifetime counters cover every source.
  EXPECT_EQ(s.GetRequest(1).stats.num_spec_steps, 8);
  // A drafter switch drops every source's evidence.
  EXPECT_TRUE(s.ResetAcceptance(1));
  EXPECT_TRUE(s.SetDraftSource(1, 0));
  EXPECT_EQ(s.GetRequest(1).draft_len, 3);
  EXPECT_LT(s.GetRequest(1).stats.TokenAcceptance(), 0.0);
  EXPECT_THROW(s.SetDraftSource(1, -1), pyspec::ValueError);
  EXPECT_THROW(s.SetDraftSource(1, pyspec::kMaxDraftSources), pyspec::ValueError);
  EXPECT_THROW(s.SetDraftSource(99, 0), pyspec::ValueError);
  auto out = s.Step();  // refused mid-step
  EXPECT_THROW(s.SetDraftSource(1, 1), pyspec::ValueError);
  pyspec::StepResult res;
  res.AddDecode(1, std::vector<int32_t>(out.draft_budget[0] + 1, 5), out.draft_budget[0],
                out.draft_budget[0]);
  s.Update(res);
  EXPECT_TRUE(s.Abort(1));
  EXPECT_FALSE(s.SetDraftSource(1, 1));
}

namespace {

// A depth-1 drafter right with probability `hit` at a cost of draft_cost + verify_cost plain steps
// per draft, for `steps` steps of one request; returns its stats and counts.
struct DepthOneRun {
  pyspec::AcceptanceStats stats;
  int spec_steps = 0, decode_steps = 0, dips = 0;
  std::vector<int> plain_runs;  // lengths of the runs of plain steps that a probe ended
};

DepthOneRun RunDepthOne(double hit_rate, double draft_cost, double verify_cost, int steps) {
  pyspec::SchedulerConfig c = CostModelConfig(1, 1, draft_cost, verify_cost);
  pyspec::Scheduler s(c, 256, 4, false);
  s.AddRequest(1, {1, 2, 3}, [] { pyspec::SamplingParams p; p.max_tokens = 4000; return p; }());
  std::mt19937 rng(7);
  std::bernoulli_distribution hit(hit_rate);
  DepthOneRun run;
  const double break_even = draft_cost + verify_cost;
  int plain_run = 0;
  for (int step = 0; step < steps; ++step) {
    auto out = s.Step();
    if (out.ids.empty()) break;
    pyspec::StepResult res;
    if (out.kinds[0] == pyspec::StepKind::kPrefill) {
      res.AddPrefill(1, out.token_indptr[1] - out.token_indptr[0]);
    } else {
      const int64_t b = out.draft_budget[0];
      const int64_t a = b > 0 && hit(rng) ? 1 : 0;
      res.AddDecode(1, std::vector<int32_t>(a + 1, 5), b, a);
      run.spec_steps += b > 0;
      ++run.decode_steps;
      if (b == 0) {
        ++plain_run;
      } else if (plain_run > 0) {
        run.plain_runs.push_back(plain_run);
        plain_run = 0;
      }
    }
    s.Update(res);
    const auto& st = s.GetRequest(1).stats;
    run.dips += st.TokenAcceptance() >= 0 && st.TokenAcceptance() < break_even;
  }
  run.stats = s.GetRequest(1).stats;
  return run;
}

}  // namespace

TEST(CostModel, AcceptanceNoiseDoesNotCauseFallbacks) {
  // Right 35% of the time at a cost of 0.24 plain steps per draft: drafting pays (expected 1.35
  // tokens per 1.24 steps), yet runs of misses are common. The point estimate (EWMA) dips below
  // the break-even 0.24 often; the fallback test must not react to that.
  DepthOneRun run = RunDepthOne(0.35, 0.09, 0.15, 400);
  EXPECT_GT(run.dips, 10);  // the noise is there
  EXPECT_EQ(run.stats.num_cost_fallbacks, 0);
  EXPECT_GT(run.spec_steps, 350);
}

TEST(CostModel, APoorDrafterStaysOffAfterProbesThatGoNoBetter) {
  // Right 5% of the time at 0.25 plain steps per draft: it loses. It falls back once the evidence
  // is clear, and each probe (kept evidence + warmup_steps new steps) confirms it quickly, so it
  // drafts on a small share of the steps.
  DepthOneRun run = RunDepthOne(0.05, 0.2, 0.05, 400);
  EXPECT_GE(run.stats.num_cost_fallbacks, 3);
  EXPECT_GE(run.stats.num_probes, 3);
  EXPECT_LT(run.spec_steps, 0.2 * run.decode_steps) << run.spec_steps << " of " << run.decode_steps;
}

TEST(CostModel, ProbesThatGoNoBetterBackOff) {
  // Each probe of a drafter that keeps losing waits twice as long as the one before (from
  // probe_interval = 32 plain steps up to kMaxProbeBackoff times that), so over a long request it
  // drafts on a shrinking share of the steps.
  DepthOneRun run = RunDepthOne(0.05, 0.2, 0.05, 1600);
  const int base = static_cast<int>(pyspec::SchedulerConfig().probe_interval);
  const int cap = static_cast<int>(pyspec::kMaxProbeBackoff) * base;
  ASSERT_GE(run.plain_runs.size(), 5u);
  for (size_t i = 0; i < run.plain_runs.size(); ++i) {
    EXPECT_EQ(run.plain_runs[i], std::min(base << i, cap)) << "plain run " << i;
  }
  EXPECT_LT(run.spec_steps, 0.06 * run.decode_steps) << run.spec_steps << " of " << run.decode_steps;
}

TEST(CostModel, ShortRequestsOnALosingDrafterStillDraftNowAndThen) {
  // Requests too short to reach a first probe, on a drafter that is never right: after the first
  // ones the deployment's evidence starts each new request plain, and each such start fades that
  // evidence (kPlainStartEvidenceDecay), so every few requests one drafts for its warmup_steps
  // again and renews it. Without the fading none would ever draft again on this scheduler.
  pyspec::SchedulerConfig c = CostModelConfig(1, 1, 0.25, 0.05);
  c.warmup_steps = 4;
  pyspec::Scheduler s(c, 256, 4, false);
  std::vector<int> drafted;
  for (int64_t id = 0; id < 60; ++id) {
    pyspec::SamplingParams p;
    p.max_tokens = 12;
    s.AddRequest(id, {1, 2, 3}, p);
    int guard = 0;
    while (!s.GetRequest(id).finished() && ++guard < 100) StepAcceptingAllOrNone(s, false);
    ASSERT_TRUE(s.GetRequest(id).finished());
    if (s.GetRequest(id).stats.num_spec_steps > 0) drafted.push_back(static_cast<int>(id));
  }
  ASSERT_FALSE(drafted.empty());
  EXPECT_EQ(drafted.front(), 0);
  EXPECT_GE(drafted.size(), 5u);                  // it keeps being re-tested ...
  EXPECT_LE(drafted.size(), 30u);                 // ... on a minority of the requests
  EXPECT_GE(drafted.back(), 40);                  // to the end
}

TEST(CostModel, AProbeThatPaysResetsTheBackoff) {
  // Two probes go no better (waits 3 then 6 plain steps); the drafter then pays for longer than
  // probe_interval steps, and after its next fallback the wait is probe_interval again.
  pyspec::SchedulerConfig c = CostModelConfig(1, 1, 0.2, 0.05);
  c.warmup_steps = 2;
  c.probe_interval = 3;
  pyspec::Scheduler s(c, 256, 4, false);
  s.AddRequest(1, {1, 2, 3}, [] { pyspec::SamplingParams p; p.max_tokens = 2000; return p; }());
  StepAcceptingAllOrNone(s, false);  // prefill
  auto until_plain = [&](bool accept_all) {
    int n = 0;
    while (s.GetRequest(1).state() != pyspec::RequestState::kRunningPlain && n < 500) {
      StepAcceptingAllOrNone(s, accept_all);
      ++n;
    }
    return n;
  };
  auto plain_steps = [&] {
    int n = 0;
    while (s.GetRequest(1).state() == pyspec::RequestState::kRunningPlain && n < 500) {
      EXPECT_EQ(StepAcceptingAllOrNone(s, false), 0);
      ++n;
    }
    return n;
  };
  EXPECT_LT(until_plain(false), 500);
  EXPECT_EQ(s.GetRequest(1).probe_wait, 3);
  EXPECT_EQ(plain_steps(), 3);
  EXPECT_EQ(until_plain(false), c.warmup_steps);  // the probe goes no better
  EXPECT_EQ(s.GetRequest(1).probe_wait, 6);
  EXPECT_EQ(plain_steps(), 6);
  for (int i = 0; i < 40; ++i) StepAcceptingAllOrNone(s, true);  // this probe pays
  ASSERT_EQ(s.GetRequest(1).state(), pyspec::RequestState::kRunningSpeculative);
  EXPECT_LT(until_plain(false), 500);
  EXPECT_EQ(s.GetRequest(1).probe_wait, 3);
  EXPECT_EQ(plain_steps(), 3);
  // A switch of drafter starts over: no backoff.
  EXPECT_LT(until_plain(false), 500);
  EXPECT_EQ(s.GetRequest(1).probe_wait, 6);
  EXPECT_TRUE(s.ResetAcceptance(1, 1));
  EXPECT_EQ(s.GetRequest(1).probe_wait, 0);
  EXPECT_TRUE(s.Abort(1));
}

TEST(CostModel, ANewRequestStartsFromTheDeploymentsEvidence) {
  // A drafter that is never right at 0.3 plain steps per draft token: the first request needs
  // about ten speculative steps of its own before even an optimistic estimate says it loses;
  // the next one starts with the deployment's evidence for that drafter (its evidence group; at
  // most kDeploymentPriorTrials trials) and falls back after its warmup_steps. Another drafter's
  // requests start from nothing. A deployment where drafts are always right gives a new request
  // no reason to fall back.
  pyspec::SchedulerConfig c = CostModelConfig(1, 1, 0.25, 0.05);
  c.warmup_steps = 4;
  c.probe_interval = 1000;
  auto params = [] { pyspec::SamplingParams p; p.max_tokens = 400; return p; };
  auto spec_steps_until_plain = [&](pyspec::Scheduler& s, int64_t id, bool accept_all) {
    s.AddRequest(id, {1, 2, 3}, params());
    StepAcceptingAllOrNone(s, accept_all);  // prefill
    int steps = 0;
    while (s.GetRequest(id).state() != pyspec::RequestState::kRunningPlain && steps < 90) {
      StepAcceptingAllOrNone(s, accept_all);
      ++steps;
    }
    EXPECT_TRUE(s.Abort(id));
    return steps;
  };
  pyspec::Scheduler s(c, 256, 4, false);
  EXPECT_EQ(s.DeploymentEvidence().second, 0.0);
  const int first = spec_steps_until_plain(s, 1, false);
  EXPECT_GE(first, 2 * c.warmup_steps);
  EXPECT_LT(first, 90);
  const auto [hits, trials] = s.DeploymentEvidence(0);
  EXPECT_EQ(hits, 0.0);
  EXPECT_GT(trials, 0.9 * first - 1.0);  // decayed by 0.99 a step
  EXPECT_LE(trials, first);
  const pyspec::Request& next = [&]() -> const pyspec::Request& {
    s.AddRequest(2, {1, 2, 3}, params());
    return s.GetRequest(2);
  }();
  EXPECT_NEAR(next.stats.fb_trials, std::min(pyspec::kDeploymentPriorTrials, trials), 1e-9);
  EXPECT_EQ(next.stats.fb_hits, 0.0);
  EXPECT_TRUE(s.Abort(2));
  // That prior already says even an optimistic acceptance loses: the next request starts plain,
  // counted as a cost fallback, and would first probe after probe_interval plain steps.
  EXPECT_EQ(spec_steps_until_plain(s, 3, false), 0);
  EXPECT_EQ(s.GetRequest(3).stats.num_cost_fallbacks, 1);
  EXPECT_EQ(s.GetRequest(3).stats.num_spec_steps, 0);
  EXPECT_EQ(s.GetRequest(3).probe_wait, c.probe_interval);
  // Another drafter's requests (another evidence group) start from nothing: as long as the first.
  auto other = params();
  other.evidence_group = 1;
  s.AddRequest(4, {1, 2, 3}, other);
  EXPECT_EQ(s.GetRequest(4).stats.fb_trials, 0.0);
  EXPECT_TRUE(s.Abort(4));
  EXPECT_EQ(s.DeploymentEvidence(1).second, 0.0);
  // A request moved to another drafter counts towards that drafter's group from then on.
  s.AddRequest(5, {1, 2, 3}, params());
  StepAcceptingAllOrNone(s, true);  // prefill
  EXPECT_TRUE(s.ResetAcceptance(5, 2));
  EXPECT_EQ(s.GetRequest(5).params.evidence_group, 2);
  StepAcceptingAllOrNone(s, true);
  EXPECT_GT(s.DeploymentEvidence(2).second, 0.0);
  EXPECT_THROW(s.ResetAcceptance(5, -2), pyspec::ValueError);
  EXPECT_TRUE(s.Abort(5));
  auto bad = params();
  bad.evidence_group = -1;
  EXPECT_THROW(s.AddRequest(6, {1, 2, 3}, bad), pyspec::ValueError);

  pyspec::Scheduler good(c, 256, 4, false);
  EXPECT_EQ(spec_steps_until_plain(good, 1, true), 90);  // never falls back
  EXPECT_EQ(spec_steps_until_plain(good, 2, true), 90);
  const auto [good_hits, good_trials] = good.DeploymentEvidence();
  EXPECT_NEAR(good_hits, good_trials, 1e-9);
  EXPECT_GT(good_trials, pyspec::kDeploymentPriorTrials);
  good.AddRequest(3, {1, 2, 3}, params());  // a long history is scaled down to the cap
  EXPECT_NEAR(good.GetRequest(3).stats.fb_trials, pyspec::kDeploymentPriorTrials, 1e-9);
  EXPECT_NEAR(good.GetRequest(3).stats.fb_hits, pyspec::kDeploymentPriorTrials, 1e-9);
}

TEST(CostModel, MemoryBoundTokensLimitTheDraftShare) {
  pyspec::SchedulerConfig c;
  c.max_draft_tokens = 8;
  c.spec_token_budget = 0;
  c.spec_disable_batch_size = 0;
  pyspec::Scheduler s(c, 64, 4, false);
  EXPECT_EQ(s.SpecShare(4, 4), 8);  // unknown: no limit
  s.SetMemoryBoundTokens(12);
  EXPECT_EQ(s.SpecShare(4, 4), 2);   // (12 - 4) / 4
  EXPECT_EQ(s.SpecShare(1, 1), 8);   // capped by max_draft_tokens
  EXPECT_EQ(s.SpecShare(12, 6), 0);  // the batch alone is compute-bound
  EXPECT_EQ(s.SpecShare(20, 1), 0);
  EXPECT_THROW(s.SetMemoryBoundTokens(-1), pyspec::ValueError);
}
