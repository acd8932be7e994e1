# `fivefold train --tp` under mpirun, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch>
#         -DMOE_CONFIG=<a deepseek_v3 config.json> -P cli_tensor_parallel.cmake
# The default model's sizes (the byte vocabulary of 259 rows splits 130 + 129 over 2 ranks and
# 65 + 65 + 65 + 64 over 4; d_ff 352) on 1 process, then tp 2 and 4, with and without sequence
# parallelism (a sequence of 15 tokens: uneven parts), combined with dp and each ZeRO stage: every
# step's loss and gradient norm in metrics.jsonl must equal the single process's. A run saved at
# tp 2 resumes on 1 process and at tp 4 x dp 1, and continues the uninterrupted curve. Bad layouts
# are refused on every rank before anything is written. Shown to fail on purpose: with f's
# backward made the identity, the first tp 2 layout fails (norm and loss).

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(common --steps 4 --batch 8 --seq 15 --d-model 64 --n-layers 2 --n-heads 4 --n-kv-heads 4
    --synthetic-examples 300 --warmup 1 --grad-clip 0.5 --eval-every 0 --exact-match 0
    --eval-batches 1 --save-every 2 --peak-gflops 100 --no-progress)

train(1 ${WORK}/single ${common})
curve(${WORK}/single want)
# Trains each layout "np,tp,zero,sp" with the run's flags (`run_flags`: a list variable's name) into
# WORK/<prefix>np..., and expects the curve named by `expected` from each.
function(expect_layouts prefix label run_flags expected)
  foreach(layout IN LISTS ARGN)
    string(REPLACE "," ";" layout "${layout}")
    list(GET layout 0 np)
    list(GET layout 1 tp)
    list(GET layout 2 zero)
    list(GET layout 3 sp)
    set(extra --tp ${tp} --zero ${zero})
    if(sp STREQUAL "on")
      list(APPEND extra --sequence-parallel)
    endif()
    set(out ${WORK}/${prefix}np${np}-tp${tp}-zero${zero}-sp${sp})
    train(${np} ${out} ${${run_flags}} ${extra})
    curve(${out} got)
    expect_same_curve("${got}" "${${expected}}" "${label}${np} ranks, tp ${tp}, ZeRO-${zero}, SP ${sp}")
  endforeach()
endfunction()

# np, tp, zero, sequence parallelism
expect_layouts("" "" common want "2,2,0,off" "2,2,1,on" "4,4,0,on" "4,2,2,off" "4,2,3,on")

# DeepSeek-V3 in miniature (MLA with YaRN, 8 routed experts and a shared one, the balancing bias
# updated after every step from the load summed over the ranks that routed different tokens).
set(moe --steps 4 --batch 8 --seq 15 --synthetic-examples 300 --warmup 1 --grad-clip 0.5
    --eval-every 0 --exact-match 0 --eval-batches 1 --save-every 0 --peak-gflops 100
    --no-progress --model-config ${MOE_CONFIG})
train(1 ${WORK}/moe-single ${moe})
curve(${WORK}/moe-single want_moe)
expect_layouts(moe- "MLA + MoE: " moe want_moe "2,2,0,on" "4,2,1,off" "4,4,2,on")

# The run saved at tp 2 (dp 2, ZeRO-3, SP) at step 2 continues on 1 process and at tp 4.
set(saved ${WORK}/np4-tp2-zero3-spon)
foreach(target "1;1" "4;4")
  list(GET target 0 np)
  list(GET target 1 tp)
  expect_resumed(${np} ${saved} ${WORK}/resumed-np${np}-tp${tp} want
                 "saved at tp 2 x dp 2, resumed on ${np} ranks at tp ${tp}" --tp ${tp})
endforeach()

# Refusals, on every rank, before anything is written: 4 heads do not split over 3 ranks; 3
# key/value heads neither split over 4 ranks nor are shared by them; sequence parallelism needs
# tp.
refused_on_every_rank(3 ${WORK}/bad "4 attention heads do not split over 3" ${common} --tp 3)
refused_on_every_rank(4 ${WORK}/bad "3 key/value heads do not split over 4" ${common} --tp 4
                      --d-model 96 --n-heads 12 --n-kv-heads 3)
refused_on_every_rank(2 ${WORK}/bad "needs --tp 2 or more" ${common} --sequence-parallel)
