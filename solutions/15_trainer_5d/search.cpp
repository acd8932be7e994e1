// Chapter 15: the search over layouts, each priced by planner.cpp's step-time model.
#include <algorithm>
#include <array>
#include <map>
#include <tuple>

#include "07_moe/moe.h"
#include "10_tensor_parallel/layers.h"
#include "15_trainer_5d/planner.h"
#include "15_trainer_5d/predict.h"
#include "fivefold/error.h"
#include "planner_parts.h"

namespace fivefold::ch15 {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(k);
  return out;
}

}  // namespace

Search search_layouts(const Workload& work, const Cluster& cluster, ch14::Precision precision,
                      const SearchLimits& limits) {
  cluster.validate();
  const int64_t keep = limits.keep, max_micro_batches = limits.max_micro_batches;
  FIVEFOLD_CHECK(keep >= 1 && max_micro_batches >= 1,
                 "search_layouts: keep and max_micro_batches must be at least 1");
  auto allowed = [](int64_t size, int64_t fixed) { return fixed == 0 || size == fixed; };
  const int64_t world = cluster.devices;
  Search search;
  const ModelTerms terms = model_terms(work);  // the same for every layout
  // What a block keeps depends on its kind (dense or MoE), the micro-batch, the mode and the
  // rank's tp and cp shares, not on the rest of the layout: each is counted once for the search.
  std::map<std::array<int64_t, 14>, int64_t> kept;
  Workload counted = work;
  counted.block_activations = [&kept, &terms, &work](
                                  const ch03::ModelConfig&, int64_t layer, int64_t rows,
                                  int64_t seq, ch14::Precision precision, ch14::Recompute mode,
                                  const ch14::TensorParallelShare& tp,
                                  const ch14::ContextParallelShare& cp,
                                  const ch14::ExpertParallelShare& ep) {
    const std::array<int64_t, 14> key = {
        terms.block[static_cast<size_t>(layer)].experts > 0, rows, seq,
        static_cast<int64_t>(precision), static_cast<int64_t>(mode), tp.ranks, tp.rank,
        tp.sequence_parallel, cp.ranks, cp.rank, static_cast<int64_t>(cp.layout),
        static_cast<int64_t>(cp.attention), ep.ranks, ep.received};
    auto found = kept.find(key);
    if (found == kept.end())
      found = kept.emplace(key, block_kept(work, layer, rows, precision, mode, tp, cp, ep)).first;
    return found->second;
  };
  // The micro-batches each rank keeps depend only on the schedule's lists, not on the costs.
  std::map<std::tuple<std::string, int64_t, int64_t, int64_t>, int64_t> in_flight;
  // The best `keep` so far, a heap with the slowest on top (a later find after an equal one),
  // sorted fastest first at the end: each find costs log(keep), however many are kept.
  using Ranked = std::pair<std::pair<double, int64_t>, Candidate>;  // (step, order found)
  std::vector<Ranked> best;
  auto slower = [](const Ranked& a, const Ranked& b) { return a.first < b.first; };
  int64_t order = 0;
  auto consider = [&](const Layout& layout, const Workload& w) {
    int64_t held = 1;
    if (layout.pp > 1) {
      const auto key =
          std::make_tuple(layout.schedule, layout.pp, layout.virtual_stages, w.micro_batches);
      auto found = in_flight.find(key);
      if (found == in_flight.end())
        found =
            in_flight
                .emplace(key, most_in_flight(ch11::simulate(schedule_of(layout, w.micro_batches))))
                .first;
      held = found->second;
    }
    search.valid += 1;
    ch11::UnitCosts costs;
    StepEstimate e = estimate_before_pipeline(w, terms, layout, cluster, precision, held, costs);
    if (e.memory_bytes() > cluster.memory_bytes) return;
    search.fit += 1;
    const bool full = static_cast<int64_t>(best.size()) >= keep;
    if (full && e.step >= best.front().first.first) return;  // the bubble only adds
    if (layout.pp > 1) {
      add_pipeline(e, ch11::simulate(schedule_of(layout, w.micro_batches), costs));
    }
    if (full && e.step >= best.front().first.first) return;
    best.push_back({{e.step, order++}, Candidate{layout, w.micro_batches, w.recompute.mode, e}});
    std::push_heap(best.begin(), best.end(), slower);
    if (static_cast<int64_t>(best.size()) > keep) {
      std::pop_heap(best.begin(), best.end(), slower);
      best.pop_back();
    }
  };
  // A model with routed experts tries every ep that divides dp·cp.
  const bool experts = ch07::has_routed_experts(work.model);
  FIVEFOLD_CHECK(experts || limits.ep <= 1, "search_layouts: ep ", limits.ep,
                 " needs a model with routed experts");
  int64_t splits = 0, done = 0;  // (tp, cp, pp, ep), for limits.progress
  for (int64_t tp : divisors(world))
    for (int64_t cp : divisors(world / tp))
      for (int64_t pp : divisors(world / (tp * cp)))
        splits += static_cast<int64_t>(divisors(experts ? world / (tp * pp) : 1).size());
  for (int64_t tp : divisors(world))
    for (int64_t cp : divisors(world / tp))
      for (int64_t pp : divisors(world / (tp * cp)))
        for (int64_t ep : divisors(experts ? world / (tp * pp) : 1)) {
          if (limits.progress) limits.progress(done++, splits, search);
          const int64_t dp = world / (tp * cp * pp);
          if (!allowed(tp, limits.tp) || !allowed(cp, limits.cp) || !allowed(pp, limits.pp) ||
              !allowed(dp, limits.dp) || !allowed(ep, limits.ep) || (dp * cp) % ep != 0)
            continue;
          if (work.batch % dp != 0) continue;  // resolve_layout refuses every m
          std::vector<std::pair<std::string, int64_t>> schedules = {{"1f1b", 1}};
          if (pp > 1) {
            schedules = {{"gpipe", 1}, {"1f1b", 1}, {"zb", 1}};
            for (int64_t v = 2; v * pp <= work.model.n_layers; ++v)  // more: fewer than a layer
              schedules.emplace_back("interleaved", v);
          }
          // Sequence parallelism asks one more thing of tp (check_tensor_parallel); the ZeRO
          // stage and cp's kernel ask nothing of the model, the batch or the schedule.
          bool sp_allowed = tp > 1;
          try {
            if (tp > 1) ch10::check_tensor_parallel(work.model, static_cast<int>(tp), true);
          } catch (const Error&) {
            sp_allowed = false;
          }
          for (int64_t m : divisors(work.batch / dp)) {
            if (m > max_micro_batches) break;
            if (!allowed(m, limits.micro_batches)) continue;
            for (const auto& [schedule, v] : schedules) {
              if ((!limits.schedule.empty() && pp > 1 && schedule != limits.schedule) ||
                  (pp > 1 && !allowed(v, limits.virtual_stages)))
                continue;
              Layout base;
              base.dp = dp;
              base.tp = tp;
              base.pp = pp;
              base.cp = cp;
              base.ep = ep;
              base.schedule = schedule;
              base.virtual_stages = v;
              Workload w = counted;
              w.micro_batches = m;
              try {
                base = resolve_layout(base, world, w);  // the trainer's own checks
              } catch (const Error&) {
                continue;
              }
              for (int zero = 0; zero <= (dp * cp > 1 ? 3 : 0); ++zero)
                for (bool sp : {false, true})
                  if (limits.zero < 0 || zero == limits.zero || dp * cp == 1)
                    for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
                      if ((sp && !sp_allowed) || (cp == 1 && attention != ch12::CpAttention::Ring))
                        continue;
                      Layout layout = base;
                      layout.zero = zero;
                      layout.sequence_parallel = sp;
                      layout.cp_attention = attention;
                      for (auto mode : {ch14::Recompute::None, ch14::Recompute::Selective,
                                        ch14::Recompute::Full}) {
                        if (limits.recompute && mode != *limits.recompute) continue;
                        w.recompute = {mode, 1, 0};
                        consider(layout, w);
                      }
                    }
            }
          }
        }
  std::sort_heap(best.begin(), best.end(), slower);
  for (auto& ranked : best) search.best.push_back(std::move(ranked.second));
  if (limits.progress) limits.progress(done, splits, search);
  search.dropped = search.valid - search.fit;
  return search;
}

}  // namespace fivefold::ch15
