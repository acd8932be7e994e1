# `fivefold train --recompute` as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch> -P cli_recompute.cmake
# A bad mode, --recompute-every or --recompute-stages is refused on every rank before anything is
# written; a run saved without recomputation resumes with it (and with full on every 2nd block on
# 2 ranks of tp), says so, and continues the curve of the run that never recomputed. `fivefold
# plan` prints the activation formulas.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(small --d-model 32 --n-layers 3 --n-heads 4 --n-kv-heads 2 --d-ff 64 --seq 16 --batch 8
    --synthetic-examples 300 --warmup 1 --grad-clip 0 --eval-every 0 --exact-match 0
    --eval-batches 1 --peak-gflops 100 --no-progress)

refused_on_every_rank(2 ${WORK}/bad-mode "recompute: 'some' is not one of none, full, selective"
                      --recompute some ${small})
refused_on_every_rank(2 ${WORK}/bad-every "--recompute-every must be >= 1, got 0"
                      --recompute full --recompute-every 0 ${small})
refused_on_every_rank(2 ${WORK}/bad-stages
                      "--recompute-stages 3 names more pipeline stages than the layout has \\(--pp 2\\)"
                      --pp 2 --accum 2 --recompute full --recompute-stages 3 ${small})

# The reference: 4 steps, no recomputation, a checkpoint at step 2.
train(1 ${WORK}/plain --steps 4 --save-every 2 ${small})
curve(${WORK}/plain plain)

# Resumes the reference's step-2 checkpoint on `np` ranks with the flags that follow: the curve
# goes on as the reference's, and the run says that its recomputation changed.
function(resume_with_recompute name np)
  expect_resumed(${np} ${WORK}/plain ${WORK}/resumed-${name} plain "resumed with ${ARGN}" ${ARGN})
  if(NOT train_output MATCHES "activation recomputation: [^\n]*\\(the run trained with none until now\\)")
    message(FATAL_ERROR "${name}: the resumed run did not say that its recomputation changed")
  endif()
endfunction()

resume_with_recompute(selective 1 --recompute selective)
resume_with_recompute(full-every-2 2 --tp 2 --recompute full --recompute-every 2)

# `fivefold plan` prints what a block keeps in each mode (chapter 14's formulas): Llama-2-7B at
# 4096 tokens, one device and rank 0 of tp 8 with sequence parallelism; nothing for GPT-2, whose
# LayerNorm and GELU blocks the formulas do not count.
set(configs ${CMAKE_CURRENT_LIST_DIR}/../02_flops_6np/configs)
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/llama2-7b.json --seq 4096 --tp 8 --json
                OUTPUT_VARIABLE plan RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "fivefold plan failed:\n${plan}")
endif()
string(JSON none GET "${plan}" activations bytes_per_block none)
string(JSON selective GET "${plan}" activations bytes_per_block selective)
string(JSON sp_full GET "${plan}" activations tensor_parallel sequence_parallel full)
string(JSON fast GET "${plan}" activations fast_paths)  # runtime::block_activation_bytes
string(JSON fast_selective GET "${plan}" activations fast_paths_by_mode selective)
string(JSON fast_full GET "${plan}" activations fast_paths_by_mode full)
message("plan: a Llama-2-7B block keeps ${none} bytes, ${selective} with selective recomputation; "
        "tp 8 with SP and full recomputation ${sp_full} on rank 0; ${fast} with the fast kernels")
if(NOT none EQUAL 3693117440 OR NOT selective EQUAL 1528856576 OR NOT sp_full EQUAL 8388608
   OR NOT fast EQUAL 1147699200 OR NOT fast_full EQUAL 67108864
   OR NOT fast_selective EQUAL 1080066048)
  message(FATAL_ERROR "fivefold plan's activation figures are not chapter 14's formulas")
endif()
# train --plan prints what each rank's blocks keep: tp 2 x pp 2 (1F1B, 4 micro-batches of 4 x 64
# tokens), full recomputation of every 2nd block: stage 0 keeps block 0's input (131,072 B) and
# block 1 whole, 2 micro-batches in flight; stage 1 one. With the lesson's kernels block 1 keeps
# 2,177,024 B (its 2 heads and 176 of d_ff; without recomputation, in parentheses, 2 x 2,177,024 a
# micro-batch); with the fast kernels, the default, 1,585,152 B (1,540 floats a token, no
# probabilities).
include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)
run("\\| 0 \\| 0, 0, 0, 0 \\| 0,1 \\|[^\n]*\\| 2308096 x 2 = 4616192 B \\(8708096 B\\) \\|[^\n]*\n[^\n]*\n\\| 2 \\| 1, 0, 0, 0 \\| 2,3 \\|[^\n]*\\| 2308096 x 1 = 2308096 B \\(4354048 B\\) \\|"
    train --plan 4 --pp 2 --tp 2 --recompute full --recompute-every 2 --accum 4 --lesson-kernels)
run("\\| 0 \\| 0, 0, 0, 0 \\| 0,1 \\|[^\n]*\\| 1716224 x 2 = 3432448 B \\(6340608 B\\) \\|"
    train --plan 4 --pp 2 --tp 2 --recompute full --recompute-every 2 --accum 4)
# On a rank of cp 4 (zigzag, ring): chapter 12's block term, and selective's at 1024 tokens.
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/llama2-7b.json --seq 4096 --cp 4 --json
                OUTPUT_VARIABLE plan RESULT_VARIABLE status)
string(JSON cp_none GET "${plan}" activations context_parallel bytes none)
string(JSON cp_selective GET "${plan}" activations context_parallel bytes selective)
message("plan --cp 4: a rank keeps ${cp_none} bytes a block, ${cp_selective} with selective")
if(NOT status EQUAL 0 OR NOT cp_none EQUAL 399155200 OR NOT cp_selective EQUAL 382214144)
  message(FATAL_ERROR "fivefold plan --cp 4's activation figures are not the formulas'")
endif()
# tp 8 inside cp 4, rank 0 (notes §1, "Under tensor and context parallelism together"): chapter
# 12's term for 4 heads and d_ff 1376 over 1024 tokens, 40,838 floats a token + RoPE's rows + the
# key positions; with sequence parallelism the residual stream's 6d + 2 and the norms' outputs' 2d
# for 128 of the 1024.
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/llama2-7b.json --seq 4096 --cp 4 --tp 8
                --json OUTPUT_VARIABLE plan RESULT_VARIABLE status)
string(JSON both_none GET "${plan}" activations context_parallel with_tensor_parallel plain none)
string(JSON both_sp GET "${plan}" activations context_parallel with_tensor_parallel
       sequence_parallel none)
# With the fast kernels and SP (notes §1): per token 6,180 floats in fp32 (SwiGLU, the output and
# log-sum-exp, q, the ring's own keys and values) and 1,888 linear inputs over 1024 tokens, the
# norms' 8,194 and their outputs' 8,192 over 128, RoPE's rows and the key positions: 41,993,216.
string(JSON both_fast GET "${plan}" activations context_parallel with_tensor_parallel fast_paths
       sequence_parallel none)
message("plan --cp 4 --tp 8: rank 0 keeps ${both_none} bytes a block, ${both_sp} with SP, "
        "${both_fast} with SP on the fast kernels")
if(NOT status EQUAL 0 OR NOT both_none EQUAL 167829504 OR NOT both_sp EQUAL 50381824
   OR NOT both_fast EQUAL 41993216)
  message(FATAL_ERROR "fivefold plan --cp 4 --tp 8's activation figures are not the formulas'")
endif()
# DeepSeek-V3 (MLA, MoE): a dense and a MoE block at 4096 tokens (notes §1, "MLA and MoE"), with
# the lesson's kernels and the fast ones, in fp32 and (--precision, not ignored) bf16.
foreach(precision fp32 bf16)
  execute_process(COMMAND ${FIVEFOLD} plan --config ${CMAKE_CURRENT_LIST_DIR}/../07_moe/configs/deepseek-v3.json
                          --seq 4096 --precision ${precision} --json
                  OUTPUT_VARIABLE plan RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "fivefold plan --precision ${precision} failed on DeepSeek-V3")
  endif()
  string(JSON ds_precision GET "${plan}" activations precision)
  set(ds_${precision} "")
  foreach(block dense_block moe_block)
    foreach(kernels lesson fast_paths)
      foreach(mode none selective full)
        string(JSON bytes GET "${plan}" activations ${block} ${kernels} ${mode})
        list(APPEND ds_${precision} ${bytes})
      endforeach()
    endforeach()
  endforeach()
  message("plan --precision ${ds_precision}: DeepSeek-V3 blocks (dense, MoE; lesson, fast; none, "
          "selective, full) keep ${ds_${precision}} bytes")
endforeach()
if(NOT ds_fp32 STREQUAL "12501188608;3894476800;117440512;3056664576;3054567424;117440512;15325413376;6718701568;117833728;6182879232;6180782080;117833728"
   OR NOT ds_bf16 STREQUAL "11359289344;2752577536;117440512;1798373376;1729167360;117440512;13361430528;4754718720;117833728;3951509504;3882303488;117833728")
  message(FATAL_ERROR "fivefold plan's DeepSeek-V3 activation figures are not the formulas'")
endif()
# Chapter 14's choice under a budget counts Llama-shaped blocks: refused for DeepSeek-V3, not
# ignored.
execute_process(COMMAND ${FIVEFOLD} plan --config ${CMAKE_CURRENT_LIST_DIR}/../07_moe/configs/deepseek-v3.json
                        --activation-budget 50e9
                OUTPUT_VARIABLE plan ERROR_VARIABLE error RESULT_VARIABLE status)
if(status EQUAL 0 OR NOT error MATCHES "--activation-budget: chapter 14's choice under a budget counts Llama-shaped")
  message(FATAL_ERROR "fivefold plan --activation-budget on DeepSeek-V3 was not refused: ${error}")
endif()
# Under a budget for the 32 blocks of one micro-batch: 50 GB rules out no recomputation (118 GB)
# and selective (48.9 GB) fits with the fewest FLOPs; 1 GB is below full recomputation's 2.1 GB.
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/llama2-7b.json --seq 4096
                        --activation-budget 50e9 --json
                OUTPUT_VARIABLE plan RESULT_VARIABLE status)
string(JSON budget_mode GET "${plan}" activations under_budget recompute)
string(JSON budget_bytes GET "${plan}" activations under_budget bytes)
message("plan --activation-budget 50e9: --recompute ${budget_mode}, ${budget_bytes} bytes")
if(NOT status EQUAL 0 OR NOT budget_mode MATCHES "^selective$" OR
   NOT budget_bytes EQUAL 48923410432)
  message(FATAL_ERROR "fivefold plan --activation-budget did not choose selective")
endif()
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/llama2-7b.json --seq 4096
                        --activation-budget 1e9 --json
                OUTPUT_VARIABLE plan RESULT_VARIABLE status)
string(JSON budget_error GET "${plan}" activations under_budget error)
if(NOT status EQUAL 0 OR NOT budget_error MATCHES "keeps 2147483648")
  message(FATAL_ERROR "fivefold plan --activation-budget 1e9 did not say why nothing fits")
endif()
# In bf16 the linear maps keep their inputs, and SwiGLU its terms, at 2 bytes (notes §5); fp16 is
# refused.
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/llama2-7b.json --seq 4096
                        --precision bf16 --json
                OUTPUT_VARIABLE plan RESULT_VARIABLE status)
string(JSON none_bf16 GET "${plan}" activations bytes_per_block none)
string(JSON precision GET "${plan}" activations precision)
message("plan --precision bf16: a Llama-2-7B block keeps ${none_bf16} bytes")
if(NOT status EQUAL 0 OR NOT none_bf16 EQUAL 3231744000 OR NOT precision STREQUAL "bf16")
  message(FATAL_ERROR "fivefold plan --precision bf16 is not chapter 14's bf16 formula")
endif()
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/llama2-7b.json --precision fp16
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE status)
if(status EQUAL 0 OR NOT err MATCHES "fp32, bf16")
  message(FATAL_ERROR "fivefold plan --precision fp16 was not refused:\n${out}${err}")
endif()
execute_process(COMMAND ${FIVEFOLD} plan --config ${configs}/gpt2.json --json
                OUTPUT_VARIABLE plan RESULT_VARIABLE status)
string(JSON has ERROR_VARIABLE missing GET "${plan}" activations)
if(NOT status EQUAL 0 OR NOT missing)
  message(FATAL_ERROR "fivefold plan printed activation figures for GPT-2")
endif()

# notes/14 §4: recomputation runs a region's collectives again. tp 2 with sequence parallelism
# on the MLA + MoE preset (the reduced parity matrix's first layout, its flags): the tp group
# carries 5,003,016 bytes a step without recomputation, what chapter 15 predicts, and 6,575,880
# with full recomputation, the blocks' forward all-gathers and reduce-scatters once more (not
# their second gathers in backward: each block's products are recomputed once).
set(matrix_row --model-config ${CMAKE_CURRENT_LIST_DIR}/../../chapters/15_trainer_5d/presets/moe-mla.json
    --seq 16 --steps 2 --batch 24 --synthetic-examples 300 --warmup 1 --grad-clip 0.5
    --eval-every 0 --eval-batches 1 --exact-match 0 --save-every 0 --peak-gflops 100 --no-progress
    --tp 2 --sequence-parallel)
foreach(mode none full)
  train(2 ${WORK}/tp-bytes-${mode} ${matrix_row} --recompute ${mode})
  file(READ ${WORK}/tp-bytes-${mode}/measured.json measured)
  string(JSON tp_bytes_${mode} GET "${measured}" per_step_bytes tp mean)
  string(JSON tp_predicted_${mode} GET "${measured}" per_step_bytes tp predicted_mean)
endforeach()
message("tp bytes a step: ${tp_bytes_none} without recomputation (predicted ${tp_predicted_none}), "
        "${tp_bytes_full} with full recomputation")
if(NOT tp_bytes_none EQUAL 5003016 OR NOT tp_predicted_none EQUAL 5003016 OR
   NOT tp_bytes_full EQUAL 6575880)
  message(FATAL_ERROR "the tp group's bytes a step are not notes/14 §4's 5,003,016 (none, as "
                      "predicted) and 6,575,880 (full)")
endif()

# Recomputation on the first pipeline stage only (--recompute-stages 1, pp 2): the curve of the
# run that never recomputed; stage 0 multiplies its blocks' forward again, stage 1 exactly what a
# pp 2 run without recomputation multiplies; and every group's bytes, each rank's state and
# FLOPs equal chapter 15's predictions, which count stage 0's second forward only.
train(2 ${WORK}/pp2-plain --steps 4 --pp 2 --accum 2 ${small})
train(2 ${WORK}/pp2-stage0 --steps 4 --pp 2 --accum 2 --recompute full --recompute-stages 1 ${small})
if(NOT train_output MATCHES "activation recomputation: full, pipeline stage 0 only")
  message(FATAL_ERROR "the run did not say that only stage 0 recomputes")
endif()
curve(${WORK}/pp2-stage0 stage0)
expect_same_curve("${stage0}" "${plain}" "pp 2, full recomputation on stage 0 only")
foreach(run pp2-plain pp2-stage0)
  file(READ ${WORK}/${run}/measured.json measured)
  string(JSON ${run}_0 GET "${measured}" matmul_flops 0)
  string(JSON ${run}_1 GET "${measured}" matmul_flops 1)
endforeach()
message("matmul FLOPs a step, stage 0 / stage 1: ${pp2-plain_0} / ${pp2-plain_1} without "
        "recomputation, ${pp2-stage0_0} / ${pp2-stage0_1} with stage 0's")
if(NOT pp2-stage0_1 EQUAL pp2-plain_1 OR NOT pp2-stage0_0 GREATER pp2-plain_0)
  message(FATAL_ERROR "--recompute-stages 1: stage 1 must multiply what it does without "
                      "recomputation and stage 0 more")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -DMEASURED=${WORK}/pp2-stage0/measured.json
                        -P ${CMAKE_CURRENT_LIST_DIR}/../../scripts/check-predicted.cmake
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text)
message("${text}")
if(NOT status EQUAL 0)
  message(FATAL_ERROR "--recompute-stages 1: the measured bytes, state or FLOPs are not the "
                      "predicted")
endif()
