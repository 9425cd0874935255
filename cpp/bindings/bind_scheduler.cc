#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "int_args.h"
#include "pyspec/check.h"
#include "pyspec/request.h"
#include "pyspec/scheduler.h"
#include "registry.h"
#include "uninitialized.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

std::vector<std::string> KindNames(const std::vector<StepKind>& kinds) {
  std::vector<std::string> out;
  for (StepKind k : kinds) out.emplace_back(StepKindName(k));
  return out;
}

std::vector<std::string> LogitsNames(const std::vector<LogitsKind>& kinds) {
  std::vector<std::string> out;
  for (LogitsKind k : kinds) {
    out.emplace_back(k == LogitsKind::kNone ? "none" : k == LogitsKind::kLast ? "last" : "all");
  }
  return out;
}

}  // namespace

void RegisterScheduler(py::module_& m) {
  m.attr("MAX_DRAFT_SOURCES") = kMaxDraftSources;
  m.attr("BUDGET_PROBE_FIRST") = kBudgetProbeFirst;
  m.attr("BUDGET_PROBE_MAX") = kBudgetProbeMax;
  m.attr("CALIBRATION_STEPS") = kCalibrationSteps;
  m.attr("REFIT_INTERVAL") = kRefitInterval;
  m.def(
      "optimal_draft_length",
      [](double alpha, double draft_cost, double verify_cost, int64_t max_len) {
        double gain = 0.0;
        int64_t g = OptimalDraftLength(alpha, draft_cost, verify_cost, max_len, &gain);
        return py::make_tuple(g, gain);
      },
      py::arg("alpha"), py::arg("draft_cost"), py::arg("verify_cost"), py::arg("max_len"),
      "(gamma, gain): the Leviathan et al. draft length maximizing expected tokens per unit time "
      "for per-token acceptance alpha, and that rate relative to plain decoding.");
  py::class_<Request>(m, "Request", "A snapshot of one request's scheduler state (a copy).")
      .def_readonly("id", &Request::id)
      .def_readonly("prompt", &Request::prompt)
      .def_readonly("generated", &Request::generated)
      .def_property_readonly("state", [](const Request& r) { return RequestStateName(r.state()); })
      .def_property_readonly("finish_reason",
                             [](const Request& r) -> py::object {
                               if (!r.finished()) return py::none();
                               return py::str(FinishReasonName(r.finish_reason()));
                             })
      .def_property_readonly("error", &Request::error)
      .def_property_readonly("finished", &Request::finished)
      .def_readonly("num_computed", &Request::num_computed)
      .def_readonly("num_decode_steps", &Request::num_decode_steps)
      .def_readonly("num_preemptions", &Request::num_preemptions)
      .def_readonly("num_cached_tokens", &Request::num_cached_tokens)
      .def_readonly("draft_len", &Request::draft_len)
      .def_readonly("draft_source", &Request::draft_source)
      .def_property_readonly("max_tokens", [](const Request& r) { return r.params.max_tokens; })
      .def_property_readonly("num_spec_steps",
                             [](const Request& r) { return r.stats.num_spec_steps; })
      .def_property_readonly("num_draft_tokens",
                             [](const Request& r) { return r.stats.num_draft_tokens; })
      .def_property_readonly("num_accepted_tokens",
                             [](const Request& r) { return r.stats.num_accepted_tokens; })
      .def_property_readonly("accepted_at", [](const Request& r) { return r.stats.accepted_at; })
      .def_property_readonly("acceptance_ewma",
                             [](const Request& r) -> py::object {
                               if (r.stats.ewma < 0) return py::none();
                               return py::float_(r.stats.ewma);
                             })
      .def_property_readonly("token_acceptance",
                             [](const Request& r) -> py::object {
                               double a = r.stats.TokenAcceptance();
                               if (a < 0) return py::none();
                               return py::float_(a);
                             })
      .def_property_readonly("num_fallbacks",
                             [](const Request& r) { return r.stats.num_fallbacks; })
      .def_property_readonly("num_cost_fallbacks",
                             [](const Request& r) { return r.stats.num_cost_fallbacks; })
      .def_property_readonly("num_probes", [](const Request& r) { return r.stats.num_probes; })
      .def_property_readonly("switch_ewma",
                             [](const Request& r) -> py::object {
                               if (r.switch_ewma < 0) return py::none();
                               return py::float_(r.switch_ewma);
                             })
      .def_readonly("switch_steps", &Request::switch_steps)
      .def_property_readonly("history", [](const Request& r) {
        std::vector<std::string> out;
        for (RequestState s : r.history) out.emplace_back(RequestStateName(s));
        return out;
      });
  RefuseUninitialized<Request>();

  py::class_<ScheduleOutput>(m, "ScheduleOutput", R"doc(
One step's batch, flattened with indptr arrays. Entry i is request ids[i]:
tokens[token_indptr[i]:token_indptr[i+1]] are the tokens to run (a prefill chunk, or the root = last
token for decode/speculative), starting at position start_pos[i]; block_tables[block_indptr[i]:...]
is its block table; slots[slot_indptr[i]:...] are the flat KV slots of the positions to commit (the
chunk, or root + draft_budget[i] draft depths; materialize the accepted path into the first
accepted + 1). kinds: "prefill" | "decode" | "speculative"; logits: "none" | "last" | "all".
pending_copies (src_block, dst_block) must be copied before the forward.)doc")
      .def("__len__", &ScheduleOutput::size)
      .def_readonly("ids", &ScheduleOutput::ids)
      .def_property_readonly("kinds", [](const ScheduleOutput& o) { return KindNames(o.kinds); })
      .def_property_readonly("logits",
                             [](const ScheduleOutput& o) { return LogitsNames(o.logits); })
      .def_readonly("start_pos", &ScheduleOutput::start_pos)
      .def_readonly("draft_budget", &ScheduleOutput::draft_budget)
      .def_readonly("tokens", &ScheduleOutput::tokens)
      .def_readonly("token_indptr", &ScheduleOutput::token_indptr)
      .def_readonly("block_tables", &ScheduleOutput::block_tables)
      .def_readonly("block_indptr", &ScheduleOutput::block_indptr)
      .def_readonly("slots", &ScheduleOutput::slots)
      .def_readonly("slot_indptr", &ScheduleOutput::slot_indptr)
      .def_readonly("pending_copies", &ScheduleOutput::pending_copies)
      .def_readonly("preempted_ids", &ScheduleOutput::preempted_ids)
      .def_readonly("finished_ids", &ScheduleOutput::finished_ids)
      .def_readonly("freed_ids", &ScheduleOutput::freed_ids)
      .def_property_readonly("num_scheduled_tokens", &ScheduleOutput::num_scheduled_tokens)
      .def_property_readonly("num_budgeted_tokens", &ScheduleOutput::num_budgeted_tokens)
      .def("tokens_of", &ScheduleOutput::TokensOf, py::arg("i"), "Tokens to run of entry i.")
      .def("block_table_of", &ScheduleOutput::BlockTableOf, py::arg("i"),
           "Block table of entry i.")
      .def("slots_of", &ScheduleOutput::SlotsOf, py::arg("i"), "KV slots of entry i.");
  RefuseUninitialized<ScheduleOutput>();

  py::class_<StepResult>(m, "StepResult", R"doc(
The runner's results for the last ScheduleOutput: add_prefill(id, num_computed) for each prefill
chunk, add_decode(id, tokens, num_drafted, num_accepted) for each decode/speculative entry (tokens =
accepted drafts + the bonus/recovered token).)doc")
      .def(py::init<>())
      .def("__len__", [](const StepResult& r) { return r.entries.size(); })
      .def(
          "add_prefill",
          [](StepResult& r, py::handle request_id, py::handle num_computed) {
            r.AddPrefill(IntArg(request_id, "request_id"), IntArg(num_computed, "num_computed"));
          },
          py::arg("request_id"), py::arg("num_computed"),
          "A prefill chunk whose KV (num_computed tokens) is now in the pages. Ints; a bad "
          "argument raises ValueError naming it.")
      .def(
          "add_decode",
          [](StepResult& r, py::handle request_id, py::handle tokens, py::handle num_drafted,
             py::handle num_accepted, py::handle num_nodes) {
            const int64_t id = IntArg(request_id, "request_id");
            std::vector<int32_t> t = TokensArg(tokens, "tokens");
            const int64_t drafted = IntArg(num_drafted, "num_drafted");
            const int64_t acc = num_accepted.is_none()
                                    ? static_cast<int64_t>(t.size()) - 1
                                    : IntArg(num_accepted, "num_accepted", "an int or None");
            const int64_t nodes =
                num_nodes.is_none() ? -1 : IntArg(num_nodes, "num_nodes", "an int or None");
            r.AddDecode(id, std::move(t), drafted, acc, nodes);
          },
          py::arg("request_id"), py::arg("tokens"), py::arg("num_drafted") = 0,
          py::arg("num_accepted") = py::none(), py::arg("num_nodes") = py::none(),
          "A decode/speculative result: emitted tokens (>= 1; a list of ints or a 1-D int "
          "tensor), drafts verified (tree levels), drafts accepted (default len(tokens) - 1), "
          "and the tree's nodes beyond the root (default: num_drafted; the cost model's nodes "
          "per level). A bad argument raises ValueError naming it.");
  RefuseUninitialized<StepResult>();

  py::class_<Scheduler>(m, "Scheduler", R"doc(
Continuous-batching scheduler over an owned BlockManager: chunked prefill, preemption by recompute,
batch-aware speculation budget, adaptive fallback to plain decoding.

Loop: out = step(); run the model on out; update(result). update() returns, per request, a
(request_id, new_tokens, finished, finish_reason) tuple. Finished requests stay queryable with
request(id) until release(id). Bad arguments (unknown ids, negative budgets, bad config, results
that do not match the last step) raise ValueError.)doc")
      .def(py::init([](int64_t num_blocks, int block_size, bool enable_prefix_cache,
                       int64_t max_num_batched_tokens, int64_t max_num_seqs,
                       int64_t max_prefill_chunk, int64_t max_draft_tokens,
                       int64_t initial_draft_tokens, int64_t spec_token_budget,
                       int64_t spec_disable_batch_size, double ewma_alpha,
                       double min_acceptance_rate, int64_t warmup_steps, int64_t probe_interval,
                       bool record_transitions, bool cost_model, double draft_cost,
                       double verify_cost, bool measure_costs, double deployment_ewma_alpha,
                       bool adapt_draft_length) {
             SchedulerConfig c;
             c.max_num_batched_tokens = max_num_batched_tokens;
             c.max_num_seqs = max_num_seqs;
             c.max_prefill_chunk = max_prefill_chunk;
             c.max_draft_tokens = max_draft_tokens;
             c.initial_draft_tokens = initial_draft_tokens;
             c.spec_token_budget = spec_token_budget;
             c.spec_disable_batch_size = spec_disable_batch_size;
             c.ewma_alpha = ewma_alpha;
             c.min_acceptance_rate = min_acceptance_rate;
             c.warmup_steps = warmup_steps;
             c.probe_interval = probe_interval;
             c.record_transitions = record_transitions;
             c.cost_model = cost_model;
             c.draft_cost = draft_cost;
             c.verify_cost = verify_cost;
             c.measure_costs = measure_costs;
             c.deployment_ewma_alpha = deployment_ewma_alpha;
             c.adapt_draft_length = adapt_draft_length;
             return new Scheduler(c, num_blocks, block_size, enable_prefix_cache);
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::kw_only(),
           py::arg("enable_prefix_cache") = true, py::arg("max_num_batched_tokens") = 2048,
           py::arg("max_num_seqs") = 64, py::arg("max_prefill_chunk") = 0,
           py::arg("max_draft_tokens") = 8, py::arg("initial_draft_tokens") = 4,
           py::arg("spec_token_budget") = 64, py::arg("spec_disable_batch_size") = 32,
           py::arg("ewma_alpha") = 0.2, py::arg("min_acceptance_rate") = 0.0,
           py::arg("warmup_steps") = 4, py::arg("probe_interval") = 32,
           py::arg("record_transitions") = false, py::arg("cost_model") = false,
           py::arg("draft_cost") = 0.0, py::arg("verify_cost") = 0.02,
           py::arg("measure_costs") = false, py::arg("deployment_ewma_alpha") = 2.0 / 65.0,
           py::arg("adapt_draft_length") = true)
      .def("set_spec_budget", &Scheduler::SetSpecBudget, py::arg("spec_token_budget"),
           py::arg("spec_disable_batch_size"),
           "Update the batch-aware speculation limits (draft tokens per step shared by the batch, "
           "0 = unlimited; batch size at which speculation stops, 0 = never).")
      .def("reset_policy", &Scheduler::ResetPolicy,
           "The speculation policy back to where it started (a rollback): the constructor's "
           "settings (costs, batch-aware limits), the cost model's measurements and the "
           "deployment-wide acceptance evidence forgotten; requests in flight keep their own "
           "estimates. Between update() and step() or with no step open.")
      .def("set_memory_bound_tokens", &Scheduler::SetMemoryBoundTokens, py::arg("tokens"),
           "Tokens a step can run before it is compute-bound (0 = unknown): draft tokens are "
           "limited to what the batch leaves of it.")
      .def_property_readonly("memory_bound_tokens",
                             [](const Scheduler& s) { return s.config().memory_bound_tokens; })
      .def_property_readonly("spec_token_budget",
                             [](const Scheduler& s) { return s.config().spec_token_budget; })
      .def_property_readonly("spec_disable_batch_size",
                             [](const Scheduler& s) { return s.config().spec_disable_batch_size; })
      .def("set_cost_model", &Scheduler::SetCostModel, py::arg("draft_cost"),
           py::arg("verify_cost"),
           "Update the measured cost ratios (per draft token, per extra verified token; both "
           "relative to one plain decode step).")
      .def("observe_step_time", &Scheduler::ObserveStepTime, py::arg("batch"), py::arg("tokens"),
           py::arg("seconds"),
           "Adaptive speculation: a decode-only step of `batch` requests ran `tokens` rows "
           "(roots and draft nodes) through the target in `seconds`.")
      .def("observe_draft_time", &Scheduler::ObserveDraftTime, py::arg("evidence_group"),
           py::arg("seconds"), py::arg("levels"),
           "Adaptive speculation: the drafter of `evidence_group` drafted `levels` tree levels "
           "in `seconds`.")
      .def("refit_cost_model", &Scheduler::RefitCostModel,
           "Refit the cost model from the measured step and draft times now (update() does every "
           "REFIT_INTERVAL steps with measure_costs=True).")
      .def_property_readonly(
          "cost_model_stats",
          [](const Scheduler& s) {
            const CostModelStats& c = s.cost_model_stats();
            py::dict d;
            d["draft_cost"] = c.draft_cost;
            d["verify_cost"] = c.verify_cost;
            d["spec_free_tokens"] = c.spec_free_tokens;
            d["budget_probes"] = c.budget_probes;
            d["calibration_steps"] = c.calibration_steps;
            d["nodes_per_level"] = s.cost_model().nodes_per_level();
            d["budget_probe_interval"] = s.cost_model().budget_probe_interval();
            return d;
          },
          "What the cost model measured: draft_cost, verify_cost (per draft level, relative to "
          "a plain step, times the batch), spec_free_tokens (None until fitted), budget_probes, "
          "calibration_steps, nodes_per_level, budget_probe_interval.")
      .def_property_readonly(
          "deployment_acceptance_ewma",
          [](const Scheduler& s) -> py::object {
            const double e = s.deployment_acceptance_ewma();
            if (e < 0) return py::none();
            return py::float_(e);
          },
          "The deployment's acceptance average (accepted / drafted levels per speculative "
          "step); None before the first.")
      .def("mark_drafter_failed", &Scheduler::MarkDrafterFailed, py::arg("request_id"),
           "The request's drafter failed: nothing more is drafted for it and calibration steps "
           "do not count it. False if finished.")
      .def(
          "switch_reason",
          [](const Scheduler& s, int64_t id, double switch_below) {
            return std::string(SwitchReasonName(s.GetSwitchReason(id, switch_below)));
          },
          py::arg("request_id"), py::arg("switch_below"),
          "Why the request should move to another drafter: 'low_acceptance' (its acceptance "
          "average with its drafter stayed below switch_below), 'cost_model' (it started plain "
          "on its drafter's evidence), or '' (neither, or switch_below <= 0).")
      .def(
          "add_request",
          [](Scheduler& s, py::handle request_id, py::handle prompt, py::handle max_tokens,
             py::handle stop_token_ids, bool speculative, py::handle evidence_group) {
            const int64_t id = IntArg(request_id, "request_id");
            std::vector<int32_t> tokens = TokensArg(prompt, "prompt");
            SamplingParams p;
            p.max_tokens = IntArg(max_tokens, "max_tokens");
            p.stop_token_ids = TokensArg(stop_token_ids, "stop_token_ids");
            p.speculative = speculative;
            const int64_t group = IntArg(evidence_group, "evidence_group");
            PYSPEC_CHECK(group >= 0 && group <= std::numeric_limits<int32_t>::max(),
                         "evidence_group must be in [0, 2^31); got ", group);
            p.evidence_group = static_cast<int32_t>(group);
            s.AddRequest(id, std::move(tokens), std::move(p));
          },
          py::arg("request_id"), py::arg("prompt"), py::kw_only(), py::arg("max_tokens") = 16,
          py::arg("stop_token_ids") = py::list(), py::arg("speculative") = true,
          py::arg("evidence_group") = 0,
          "Queue a request (WAITING). evidence_group: requests of one drafter share one (its "
          "recent cost-model evidence is a new request's prior). ValueError for a duplicate id, "
          "an empty prompt, max_tokens < 1 or a negative evidence_group.")
      .def("abort", &Scheduler::Abort, py::arg("request_id"),
           "Finish with 'abort' from any state, freeing its KV now. False if already finished.")
      .def("release", &Scheduler::Release, py::arg("request_id"),
           "Forget a finished request.")
      .def("reset_acceptance", &Scheduler::ResetAcceptance, py::arg("request_id"),
           py::arg("evidence_group") = -1,
           "Another drafter serves the request: drop the acceptance evidence about the previous "
           "one, restart its draft length and leave plain decoding; its steps count towards "
           "`evidence_group` from now on (-1: unchanged). Between update() and step(); False if "
           "finished.")
      .def("deployment_evidence", &Scheduler::DeploymentEvidence, py::arg("evidence_group") = 0,
           "(accepted draft tokens, trials) of an evidence group's requests, decayed by 0.99 per "
           "speculative request-step: a new request's prior for the cost model's fallback test.")
      .def("set_draft_source", &Scheduler::SetDraftSource, py::arg("request_id"),
           py::arg("source"),
           "The request's next steps are drafted by source `source` of its drafter (a part of "
           "`A|B`, a prompt-lookup match length): use that source's own acceptance estimate and "
           "draft length (each source keeps its own). "
           "Between update() and step(); False if finished.")
      .def("step", &Scheduler::Step, "Build the next batch (a ScheduleOutput).")
      .def(
          "update",
          [](Scheduler& s, const StepResult& r) {
            py::list out;
            for (const RequestOutput& o : s.Update(r)) {
              py::object reason = py::none();
              if (o.finished) reason = py::str(FinishReasonName(o.finish_reason));
              out.append(py::make_tuple(o.id, o.new_tokens, o.finished, reason));
            }
            return out;
          },
          py::arg("result"),
          "Apply the runner's StepResult; returns [(request_id, new_tokens, finished, "
          "finish_reason)].")
      .def(
          "request", [](const Scheduler& s, int64_t id) { return s.GetRequest(id); },
          py::arg("request_id"), "A copy of the request's state (ValueError if unknown).")
      .def("has_request", &Scheduler::HasRequest, py::arg("request_id"))
      .def("spec_share", &Scheduler::SpecShare, py::arg("n_running"), py::arg("n_spec"),
           "The batch-aware per-request draft budget cap for n_running requests of which n_spec "
           "speculate.")
      .def("check_invariants", &Scheduler::CheckInvariants,
           "Verify queue/state/KV consistency (RuntimeError on a violation). For tests.")
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("waiting_queue",
                             [](const Scheduler& s) {
                               return std::vector<int64_t>(s.waiting_queue().begin(),
                                                           s.waiting_queue().end());
                             })
      .def_property_readonly("running_queue", &Scheduler::running_queue)
      .def_property_readonly("finished_ids", &Scheduler::finished_ids)
      .def_property_readonly("num_steps", &Scheduler::num_steps)
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions)
      .def_property_readonly("kv_usage_ratio",
                             [](const Scheduler& s) { return s.block_manager().usage_ratio(); })
      .def_property_readonly("prefix_cache_hit_ratio",
                             [](const Scheduler& s) { return s.block_manager().hit_ratio(); })
      .def_property_readonly("num_free_blocks",
                             [](const Scheduler& s) { return s.block_manager().num_free_blocks(); })
      .def_property_readonly("num_total_blocks", [](const Scheduler& s) {
        return s.block_manager().num_total_blocks();
      });
  RefuseUninitialized<Scheduler>();
}

}  // namespace bindings
}  // namespace pyspec
