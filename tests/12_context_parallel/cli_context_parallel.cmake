# `fivefold train --cp` under mpirun, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch>
#         -DMOE_CONFIG=<a deepseek_v3 config.json> -P cli_context_parallel.cmake
# The byte vocabulary, 4 layers, a global batch of 8 rows of 16 tokens: cp 2 and 4 with both
# layouts and both kernels, cp 2 with dp 2 and ZeRO 1 and 3, with tp 2 and sequence parallelism,
# with pp 2; 15 tokens (contiguous parts of 8 + 7 and 4 + 4 + 4 + 3); DeepSeek-V3 in miniature
# (MLA with YaRN, experts): every step's loss and gradient norm in metrics.jsonl equal the single
# process's. A run saved at cp 2 resumes on 1 process and at pp 2 x cp 2. Bad layouts are refused
# on every rank before anything is written. Shown to fail on purpose: the loss weight cp·n_r/n
# left at 1 fails the first uneven (15-token) layout.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(common --steps 4 --batch 8 --seq 16 --d-model 64 --n-layers 4 --n-heads 4 --n-kv-heads 2
    --synthetic-examples 300 --warmup 1 --grad-clip 0.5 --eval-every 0 --exact-match 0
    --eval-batches 1 --save-every 2 --peak-gflops 100 --no-progress)

# Trains each layout "np,cp,dp,tp,pp,zero,cp-layout,cp-attention,accum[,sp]" with the run's
# flags (`run_flags`: a list variable's name) into WORK/<prefix>..., and expects the curve named
# by `expected`.
function(expect_layouts prefix label run_flags expected)
  foreach(layout IN LISTS ARGN)
    string(REPLACE "," ";" fields "${layout}")
    list(GET fields 0 np)
    list(GET fields 1 cp)
    list(GET fields 2 dp)
    list(GET fields 3 tp)
    list(GET fields 4 pp)
    list(GET fields 5 zero)
    list(GET fields 6 split)
    list(GET fields 7 kernel)
    list(GET fields 8 accum)
    set(extra --cp ${cp} --dp ${dp} --tp ${tp} --pp ${pp} --zero ${zero} --cp-layout ${split}
        --cp-attention ${kernel} --accum ${accum})
    list(LENGTH fields n)
    if(n GREATER 9)
      list(APPEND extra --sequence-parallel)
    endif()
    string(REPLACE "," "-" name "${layout}")
    set(out ${WORK}/${prefix}${name})
    train(${np} ${out} ${${run_flags}} ${extra})
    curve(${out} got)
    expect_same_curve("${got}" "${${expected}}" "${label}${np} ranks: cp ${cp} ${split} ${kernel}, dp ${dp}, tp ${tp}, pp ${pp}, ZeRO-${zero}, ${accum} micro-batches")
  endforeach()
endfunction()

train(1 ${WORK}/single ${common})
curve(${WORK}/single want)
expect_layouts("" "" common want
  "2,2,1,1,1,0,zigzag,ring,1" "2,2,1,1,1,0,contiguous,allgather,2"
  "4,4,1,1,1,0,zigzag,allgather,1" "4,4,1,1,1,0,contiguous,ring,1"
  "4,2,2,1,1,1,zigzag,ring,2" "4,2,2,1,1,3,contiguous,allgather,1"
  "4,2,1,2,1,0,zigzag,ring,1,sp" "4,2,1,1,2,0,zigzag,ring,2")

# 15 tokens: the contiguous parts are unequal, and each rank's mean counts cp·n_r/n.
set(uneven ${common} --seq 15)
train(1 ${WORK}/uneven-single ${uneven})
curve(${WORK}/uneven-single want_uneven)
expect_layouts(uneven- "15 tokens: " uneven want_uneven
  "2,2,1,1,1,0,contiguous,ring,1" "4,4,1,1,1,0,contiguous,allgather,2")

# DeepSeek-V3 in miniature: MLA (YaRN positions on the rotary part) and experts, whose balancing
# bias is updated from the load summed over dp x cp.
set(moe --steps 4 --batch 8 --seq 16 --synthetic-examples 300 --warmup 1 --grad-clip 0.5
    --eval-every 0 --exact-match 0 --eval-batches 1 --save-every 0 --peak-gflops 100
    --no-progress --model-config ${MOE_CONFIG})
train(1 ${WORK}/moe-single ${moe})
curve(${WORK}/moe-single want_moe)
expect_layouts(moe- "MLA + MoE: " moe want_moe "2,2,1,1,1,0,zigzag,ring,1"
  "4,2,2,1,1,2,contiguous,allgather,1")

# The run saved at cp 2 (zig-zag, ring) at step 2 continues on 1 process and at pp 2 x cp 2.
set(saved ${WORK}/2-2-1-1-1-0-zigzag-ring-1)
foreach(target "1;1;1" "4;2;2")
  list(GET target 0 np)
  list(GET target 1 cp)
  list(GET target 2 pp)
  expect_resumed(${np} ${saved} ${WORK}/resumed-np${np}-cp${cp}-pp${pp} want
                 "saved at cp 2, resumed on ${np} ranks at cp ${cp}, pp ${pp}" --cp ${cp} --pp ${pp})
endforeach()

# Refusals, on every rank, before anything is written.
refused_on_every_rank(2 ${WORK}/bad "2 x cp = 4 equal chunks" ${common} --cp 2 --seq 15)
refused_on_every_rank(2 ${WORK}/bad "need --cp 2 or more" ${common} --cp-layout contiguous)
refused_on_every_rank(4 ${WORK}/bad "does not divide the 4 processes" ${common} --cp 3)
refused_on_every_rank(2 ${WORK}/bad "choose ring or allgather" ${common} --cp 2
                      --cp-attention flash)
