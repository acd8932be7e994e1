# `fivefold train --pp` under mpirun, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch>
#         -DMOE_CONFIG=<a deepseek_v3 config.json> -P cli_pipeline_parallel.cmake
# The byte vocabulary, 5 layers (3 + 2 over 2 stages, 2 + 1 + 1 + 1 over 4 and over 2 ranks of 2
# virtual stages), a global batch of 12 rows: every schedule at pp 2 with --accum 1 to 4, pp 4,
# pp 2 with dp 2 and ZeRO 1-3 and with tp 2 and sequence parallelism, tied embeddings (split
# between the first and the last stage), DeepSeek-V3 in miniature over 3 stages (the first holds
# only the dense layer): every step's loss and gradient norm in metrics.jsonl equal the single
# process's. A run saved at pp 2 resumes on 1 process and at pp 4. Bad layouts are refused on
# every rank before anything is written. Shown to fail on purpose: each micro-batch's loss left
# unweighted by its share of the rows fails the first layout with accum > 1.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(common --steps 4 --batch 12 --seq 15 --d-model 64 --n-layers 5 --n-heads 4
    --synthetic-examples 300 --warmup 1 --grad-clip 0.5 --eval-every 0 --exact-match 0
    --eval-batches 1 --save-every 2 --peak-gflops 100 --no-progress)

# Trains each layout "np,pp,tp,zero,schedule,v,accum[,sp]" with the run's flags (`run_flags`: a
# list variable's name) into WORK/<prefix>..., and expects the curve named by `expected`.
function(expect_layouts prefix label run_flags expected)
  foreach(layout IN LISTS ARGN)
    string(REPLACE "," ";" fields "${layout}")
    list(GET fields 0 np)
    list(GET fields 1 pp)
    list(GET fields 2 tp)
    list(GET fields 3 zero)
    list(GET fields 4 schedule)
    list(GET fields 5 v)
    list(GET fields 6 accum)
    set(extra --pp ${pp} --tp ${tp} --zero ${zero} --schedule ${schedule} --virtual-stages ${v}
        --accum ${accum})
    list(LENGTH fields n)
    if(n GREATER 7)
      list(APPEND extra --sequence-parallel)
    endif()
    string(REPLACE "," "-" name "${layout}")
    set(out ${WORK}/${prefix}${name})
    train(${np} ${out} ${${run_flags}} ${extra})
    curve(${out} got)
    expect_same_curve("${got}" "${${expected}}" "${label}${np} ranks: pp ${pp}, tp ${tp}, ZeRO-${zero}, ${schedule}, v ${v}, ${accum} micro-batches")
  endforeach()
endfunction()

train(1 ${WORK}/single ${common})
curve(${WORK}/single want)
expect_layouts("" "" common want
  "2,2,1,0,gpipe,1,4" "2,2,1,0,1f1b,1,3" "2,2,1,0,interleaved,2,2" "2,2,1,0,zb,1,1"
  "4,4,1,0,1f1b,1,4" "4,2,1,1,zb,1,3" "4,2,1,2,interleaved,2,2" "4,2,1,3,gpipe,1,3"
  "4,2,2,0,1f1b,1,2,sp")

set(tied ${common} --tied)
train(1 ${WORK}/tied-single ${tied})
curve(${WORK}/tied-single want_tied)
expect_layouts(tied- "tied: " tied want_tied "2,2,1,0,zb,1,2" "4,4,1,0,gpipe,1,1")

# DeepSeek-V3 in miniature: 3 layers, the first dense, then MLA with experts; the balancing
# bias updated by each stage for its own layers.
set(moe --steps 4 --batch 12 --seq 15 --synthetic-examples 300 --warmup 1 --grad-clip 0.5
    --eval-every 0 --exact-match 0 --eval-batches 1 --save-every 0 --peak-gflops 100
    --no-progress --model-config ${MOE_CONFIG})
train(1 ${WORK}/moe-single ${moe})
curve(${WORK}/moe-single want_moe)
expect_layouts(moe- "MLA + MoE: " moe want_moe "3,3,1,0,zb,1,3" "4,2,1,1,1f1b,1,2")

# The run saved at pp 2 (1F1B, 3 micro-batches) at step 2 continues on 1 process and at pp 4.
set(saved ${WORK}/2-2-1-0-1f1b-1-3)
foreach(target "1;1" "4;4")
  list(GET target 0 np)
  list(GET target 1 pp)
  expect_resumed(${np} ${saved} ${WORK}/resumed-np${np}-pp${pp} want
                 "saved at pp 2, resumed on ${np} ranks at pp ${pp}" --pp ${pp})
endforeach()

# Refusals, on every rank, before anything is written.
refused_on_every_rank(4 ${WORK}/bad "the model has only 2 layers" ${common} --pp 4 --n-layers 2)
refused_on_every_rank(2 ${WORK}/bad "must be a multiple of it" ${common} --pp 2
                      --schedule interleaved --virtual-stages 2 --accum 3)
refused_on_every_rank(2 ${WORK}/bad "needs --schedule interleaved" ${common} --pp 2
                      --virtual-stages 2)
refused_on_every_rank(2 ${WORK}/bad "need --pp 2 or more" ${common} --schedule zb)
refused_on_every_rank(2 ${WORK}/bad "unknown pipeline schedule 'pipedream'" ${common} --pp 2
                      --schedule pipedream)
