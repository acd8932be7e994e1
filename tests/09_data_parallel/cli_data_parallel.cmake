# `fivefold train` data-parallel under mpirun, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch> [-DMOE_CONFIG=..]
#         -P cli_data_parallel.cmake
# The same run (global batch 8, 4 steps, AdamW with clipping) on 1 process and on 2 and 4 ranks
# with each ZeRO stage and with gradient accumulation: every step's loss and gradient norm
# (before clipping) in metrics.jsonl must equal the single process's. A missing 1/N in the
# gradient average multiplies the norm by N: removing it from DDP's bucket (ddp.cpp) or from
# ZeRO's gradient pack (zero.cpp) fails the first 2-rank layout of that kind (tried). Then resume across layouts: a run
# saved on 4 ranks with ZeRO-3 resumes on 2 ranks with ZeRO-1 and on 1 process, and continues
# the uninterrupted curve. Bad layouts are refused on every rank before anything runs.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)  # train, curve, expect_same_curve

set(common --steps 4 --batch 8 --seq 16 --d-model 32 --n-layers 2 --n-heads 4 --n-kv-heads 2
    --d-ff 64 --synthetic-examples 300 --warmup 1 --grad-clip 0.5 --eval-every 0 --exact-match 0
    --eval-batches 1 --save-every 2 --peak-gflops 100 --no-progress)

train(1 ${WORK}/single ${common})
curve(${WORK}/single want)
foreach(layout "2;0;1" "2;1;1" "2;3;2" "4;0;1" "4;2;1" "4;3;2")
  list(GET layout 0 np)
  list(GET layout 1 zero)
  list(GET layout 2 accum)
  set(out ${WORK}/np${np}-zero${zero}-accum${accum})
  train(${np} ${out} ${common} --zero ${zero} --accum ${accum})
  curve(${out} got)
  expect_same_curve("${got}" "${want}" "${np} ranks, ZeRO-${zero}, accum ${accum}")
endforeach()

# A run saved on 4 ranks with ZeRO-3 at step 2 continues on 2 ranks (ZeRO-1) and on 1 process.
set(saved ${WORK}/np4-zero3-accum2)
foreach(target "2;1" "1;0")
  list(GET target 0 np)
  list(GET target 1 zero)
  expect_resumed(${np} ${saved} ${WORK}/resumed-np${np} want
                 "saved on 4 ranks (ZeRO-3), resumed on ${np}" --zero ${zero})
endforeach()

# Refusals, on every rank, before anything is written.
foreach(bad "--ep;2;no routed experts to distribute" "--tp;3;does not divide" "--dp;3;must equal the number of processes"
            "--zero;4;must be 0, 1, 2 or 3" "--accum;3;must split into 2 data-parallel ranks")
  list(GET bad 0 flag)
  list(GET bad 1 value)
  list(GET bad 2 expect)
  refused_on_every_rank(2 ${WORK}/bad "${expect}" ${common} ${flag} ${value})
endforeach()

# `fivefold plan --dp` prints ZeRO's memory both ways: fp32, and mixed precision as `--precision
# bf16` trains (bf16 weights and gradients, fp32 master weights and moments). Llama-2-7B over 64
# ranks, ZeRO-1: 2 x 2 x 6,738,415,616 + 12 x ceil(6,738,415,616 / 64) = 28,217,115,392 bytes.
execute_process(COMMAND ${FIVEFOLD} plan --config ${CMAKE_CURRENT_LIST_DIR}/../02_flops_6np/configs/llama2-7b.json
                        --dp 64 --json
                OUTPUT_VARIABLE plan RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "fivefold plan failed: ${plan}")
endif()
string(JSON mixed GET "${plan}" zero_bf16 1 total)
string(JSON fp32 GET "${plan}" zero 1 total)
if(NOT mixed EQUAL 28217115392 OR NOT fp32 EQUAL 54749626880)
  message(FATAL_ERROR "plan's ZeRO-1 per rank: ${mixed} in bf16 (want 28217115392), ${fp32} in fp32 (want 54749626880)")
endif()
message("plan --dp 64, Llama-2-7B, ZeRO-1 per rank: ${fp32} bytes in fp32, ${mixed} with master weights")
