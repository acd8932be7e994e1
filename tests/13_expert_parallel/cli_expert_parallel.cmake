# `fivefold train --ep` under mpirun, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch>
#         -DMOE_CONFIG=<a deepseek_v3 config.json> -P cli_expert_parallel.cmake
# DeepSeek-V3 in miniature (MLA with YaRN, 8 routed experts, 2 per token, one shared, the
# balancing bias), a global batch of 8 rows of 16 tokens: ep 2 and 4, with the experts'
# replicas averaged over edp (ep 2 of dp 4, ep 4 of dp 8), ZeRO 0 to 3, gradient accumulation,
# folded into context parallelism (ep over dp x cp), and inside tensor (with and without sequence
# parallelism) and pipeline parallelism; every step's loss and gradient norm in metrics.jsonl
# equal the single process's. A run saved at ep 2 resumes on 1 process, at ep 4 and at
# pp 2 x ep 2. Bad layouts are refused on every rank before anything is written. Shown to fail
# on purpose: the loss weight left at 1 (no 1/ep) fails the first layout.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(moe --steps 4 --batch 8 --seq 16 --synthetic-examples 300 --warmup 1 --grad-clip 0.5
    --eval-every 0 --exact-match 0 --eval-batches 1 --save-every 2 --peak-gflops 100
    --no-progress --model-config ${MOE_CONFIG})

# Trains each layout "np,ep,dp,cp,zero,accum,tp,pp[,sp]" into WORK/<name> and expects the
# single curve.
function(expect_layouts)
  foreach(layout IN LISTS ARGN)
    string(REPLACE "," ";" fields "${layout}")
    list(GET fields 0 np)
    list(GET fields 1 ep)
    list(GET fields 2 dp)
    list(GET fields 3 cp)
    list(GET fields 4 zero)
    list(GET fields 5 accum)
    list(GET fields 6 tp)
    list(GET fields 7 pp)
    set(extra --ep ${ep} --dp ${dp} --cp ${cp} --zero ${zero} --accum ${accum} --tp ${tp}
        --pp ${pp})
    list(LENGTH fields n)
    if(n GREATER 8)
      list(APPEND extra --sequence-parallel)
    endif()
    string(REPLACE "," "-" name "${layout}")
    train(${np} ${WORK}/${name} ${moe} ${extra})
    curve(${WORK}/${name} got)
    expect_same_curve("${got}" "${want}" "${np} ranks: ep ${ep} of dp ${dp} x cp ${cp}, tp ${tp}, pp ${pp}, ZeRO-${zero}, ${accum} micro-batches")
  endforeach()
endfunction()

train(1 ${WORK}/single ${moe})
curve(${WORK}/single want)
expect_layouts("2,2,2,1,0,1,1,1" "2,2,2,1,2,2,1,1" "4,4,4,1,1,1,1,1" "4,2,4,1,0,2,1,1"
               "4,2,2,2,1,1,1,1" "4,4,2,2,0,1,1,1" "4,2,2,1,1,1,2,1" "4,2,2,1,0,1,2,1,sp"
               "4,2,2,1,2,2,1,2" "4,2,4,1,3,1,1,1" "8,4,8,1,1,1,1,1")

# The run saved at ep 2 at step 2 continues on 1 process, and on 4 at ep 4.
set(saved ${WORK}/2-2-2-1-0-1-1-1)
foreach(target "1;1" "4;4")
  list(GET target 0 np)
  list(GET target 1 ep)
  expect_resumed(${np} ${saved} ${WORK}/resumed-np${np}-ep${ep} want
                 "saved at ep 2, resumed on ${np} ranks at ep ${ep}" --ep ${ep})
endforeach()

expect_resumed(4 ${saved} ${WORK}/resumed-np4-pp2-ep2 want
               "saved at ep 2, resumed on 4 ranks at pp 2 x ep 2" --ep 2 --pp 2)

# Refusals, on every rank, before anything is written.
refused_on_every_rank(4 ${WORK}/bad "must split evenly" ${moe} --ep 3)
refused_on_every_rank(2 ${WORK}/bad "does not divide the 2 data-parallel ranks" ${moe} --ep 4)
refused_on_every_rank(2 ${WORK}/bad "no routed experts" --steps 1 --ep 2)
refused_on_every_rank(4 ${WORK}/bad "does not divide the 2 data-parallel ranks" ${moe} --ep 4
                      --tp 2)
