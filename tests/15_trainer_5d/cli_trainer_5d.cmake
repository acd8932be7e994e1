# `fivefold train` in the main job's 5D layout and across layouts, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch> -DROOT=<repo>
#         -P cli_trainer_5d.cmake
# The main preset (chapters/15_trainer_5d/presets/main.toml: MLA + experts, dp 2 x tp 2 (SP) x
# pp 2 x cp 2, ep 2, ZeRO-1) shortened to 4 steps of 8 rows of 16 tokens; command-line options
# win over the file's. Every step's loss and gradient norm equal the single process's, and every
# dimension's group carried bytes (measured.json); the run's settings.toml trains the same run
# again; --trace writes every rank's timeline; a run saved in one layout resumes in another (5D -> dp 4, tp 2 x pp 2 -> dp 4 and -> 5D
# with ZeRO-1, dp 4 -> pp 2 x cp 2 x ep 2); fivefold compare accepts the curves and refuses a
# different one; text tokenized by a SentencePiece model trained here trains under tp 2; a loss
# that overflows stops the run naming the step and keeps the last good checkpoint; bad layouts
# and settings are refused on every rank before anything is written.
# Shown to fail: before a resumed optimizer gave the parameters with saved moments the zero
# gradient one device keeps for them, the resume 5D -> dp 4 failed at step 4 (gradient norm
# 1.78097 vs 1.78007: an expert no token chose was not stepped); with the context-parallel step
# left out of compose_step (cp ranks computing whole rows redundantly, the same curve) the
# measured.json check fails (no bytes through cp).

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(preset ${ROOT}/chapters/15_trainer_5d/presets/main.toml)
set(short --model-config ${ROOT}/chapters/15_trainer_5d/presets/moe-mla.json --steps 4 --batch 8
    --accum 2 --seq 16 --synthetic-examples 300 --warmup 1 --eval-every 0 --eval-batches 1
    --save-every 2 --peak-gflops 100 --no-progress)
set(one_process --tp 1 --pp 1 --cp 1 --ep 1 --zero 0 --sequence-parallel=false)

# --plan 16 on one process, no mpirun: each rank's row of the layout, its part of the model built
# here over offline communicators (its tp slice of stage 1 with 4 of each layer's 8 experts:
# 85,504 parameters) with the formulas' bytes, which the 16-rank run below then measures (pp
# 4096 and cp 82,496 bytes a step, notes §3; its model state 1,026,112 bytes with the 16
# frozen numbers of two layers' balancing bias; what its blocks keep for backward, ~122,432 bytes
# (the fast kernels' MLA and MoE formula for its tp and cp share, the routing's balanced
# expectation under ep: 113,984 and, for each of its 2 MoE blocks, chapter 14's ep term of its
# 2 rows x 4 own tokens x k 2 assignments at 4d + 8 = 264 bytes; 1F1B's last stage holds one
# micro-batch; ~156,224 with --lesson-kernels, chapter 14's formula for the lesson's kernels); tp
# 419,968 bytes, of which 32,768 the blocks' second gathers in backward (2 a block, 2 blocks, 2
# micro-batches of 16 tokens x d 64 x 4 bytes); its matmul FLOPs ~9,523,200 a step, the
# balanced-routing expectation, which the run's sum over the ranks equals); a layout the world
# cannot hold is refused as the run would be.
include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)
run("\\| 15 \\| 1, 1, 1, 1 \\| 2,3 \\| 85504 \\| 1026112 B \\| ~122432 x 1 = 122432 B \\| ~9523200 \\| cp 82496, edp 684256, ep 211216, pp 8, pp\\+tp 8, pp-activations 4096, pp-gradients 4096, tp 419968 \\|"
    train --config ${preset} ${short} --plan 16)
run("\\| 15 \\| 1, 1, 1, 1 \\| 2,3 \\| 85504 \\| 1026112 B \\| ~156224 x 1 = 156224 B \\|"
    train --config ${preset} ${short} --plan 16 --lesson-kernels)
# Without tp the plan counts the parameters and predicts edp and ep too: each rank of the second
# stage holds 111,232 of them (its 4 of each layer's 8 experts); a run of this layout measured
# edp 890,080 bytes a step on those ranks and ep 382,544 on the mean over all (2026-12-03).
run("\\| 4 \\| 1, 0, 0, 0 \\| 2,3 \\| 111232 \\|[^\n]*edp 890080, ep 379664,"
    train --config ${preset} ${short} --tp 1 --sequence-parallel=false --plan 8)
refused("does not divide the 12 processes" train --config ${preset} ${short} --plan 12)

# One process with the preset's settings, every dimension 1: the reference curve.
train(1 ${WORK}/single --config ${preset} ${short} ${one_process})
curve(${WORK}/single want)

# The 5D layout of the preset on 16 processes.
train(16 ${WORK}/5d --config ${preset} ${short})
curve(${WORK}/5d got)
expect_same_curve("${got}" "${want}" "16 ranks: dp 2 x tp 2 (SP) x pp 2 x cp 2, ep 2, ZeRO-1")
if(NOT EXISTS ${WORK}/5d/measured.json)
  message(FATAL_ERROR "the 5D run wrote no measured.json")
endif()
file(READ ${WORK}/5d/measured.json measured)
foreach(group tp pp cp ep edp)
  string(JSON bytes GET "${measured}" per_step_bytes ${group} mean)
  if(bytes LESS_EQUAL 0)
    message(FATAL_ERROR "measured.json: no bytes through ${group}")
  endif()
endforeach()
# Between the two stages, per step and rank: (B/dp) rows x s/(cp x tp under SP) tokens x d x 4
# bytes = 4 x 4 x 64 x 4 (notes/15_trainer_5d.md §3), activations forward and gradients back.
foreach(link pp-activations pp-gradients)
  foreach(stat mean max)
    string(JSON bytes GET "${measured}" per_step_bytes ${link} ${stat})
    if(NOT bytes EQUAL 4096)
      message(FATAL_ERROR "measured.json: ${link} ${stat} ${bytes} bytes a step, not 4096")
    endif()
  endforeach()
endforeach()
# The trainer's prediction (chapters 09-13's formulas, per rank) beside each measurement, for
# every group: equal on the mean and on the busiest rank (ep: on the mean; one rank's share
# follows the routing).
foreach(group pp-activations pp-gradients pp pp+tp cp tp ep edp)
  string(JSON predicted ERROR_VARIABLE none GET "${measured}" per_step_bytes ${group} predicted_mean)
  if(none)
    message(FATAL_ERROR "measured.json: no prediction for ${group}")
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} -DMEASURED=${WORK}/5d/measured.json
                -P ${ROOT}/scripts/check-predicted.cmake RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "the 5D run's measured bytes differ from the prediction")
endif()

# --trace: each rank's timeline (Chrome trace JSON) with its steps and its communication, on the
# training thread and, for queued operations, the communicators' worker; the curve is unchanged.
train(4 ${WORK}/traced ${short} --tp 2 --pp 2 --trace)
curve(${WORK}/traced got)
expect_same_curve("${got}" "${want}" "4 ranks with --trace: tp 2 x pp 2")
foreach(rank 0 1 2 3)
  set(file ${WORK}/traced/trace/rank-${rank}.json)
  if(NOT EXISTS ${file})
    message(FATAL_ERROR "--trace wrote no ${file}")
  endif()
  file(READ ${file} timeline)
  string(JSON events LENGTH "${timeline}" traceEvents)  # fails unless it is JSON
  foreach(want_event "\"name\":\"step 1\"" "\"name\":\"step 4\"" "\"name\":\"checkpoint\""
          "\"name\":\"rank ${rank}\"" "\"cat\":\"comm\"" " tp\"" "pp-")
    string(FIND "${timeline}" "${want_event}" at)
    if(at LESS 0)
      message(FATAL_ERROR "${file} (${events} events) has no ${want_event}")
    endif()
  endforeach()
endforeach()
file(READ ${WORK}/traced/trace/rank-0.json timeline)
string(FIND "${timeline}" "\"name\":\"send pp-activations\"" at)
if(at LESS 0)
  message(FATAL_ERROR "rank 0 (the first stage) traced no send of activations")
endif()

# The settings a run wrote train the same run again.
train(1 ${WORK}/again --config ${WORK}/single/settings.toml --out ${WORK}/again)
curve(${WORK}/again got)
expect_same_curve("${got}" "${want}" "settings.toml read back")

# Other layouts of the same run, and resumes between layouts at step 2.
train(4 ${WORK}/dp4 --config ${preset} ${short} ${one_process} --dp 4)
curve(${WORK}/dp4 got)
expect_same_curve("${got}" "${want}" "4 ranks: dp 4")
train(4 ${WORK}/tp2pp2 --config ${preset} ${short} ${one_process} --tp 2 --pp 2)
curve(${WORK}/tp2pp2 got)
expect_same_curve("${got}" "${want}" "4 ranks: tp 2 x pp 2")
expect_resumed(4 ${WORK}/5d ${WORK}/5d-to-dp4 want "saved in 5D, resumed at dp 4")
expect_resumed(4 ${WORK}/tp2pp2 ${WORK}/tp2pp2-to-dp4 want "saved at tp 2 x pp 2, resumed at dp 4")
expect_resumed(4 ${WORK}/dp4 ${WORK}/dp4-to-pp2cp2 want "saved at dp 4, resumed at pp 2 x cp 2 x ep 2"
               --pp 2 --cp 2 --ep 2)
expect_resumed(16 ${WORK}/tp2pp2 ${WORK}/tp2pp2-to-5d want "saved at tp 2 x pp 2, resumed in 5D"
               --tp 2 --sequence-parallel --pp 2 --cp 2 --ep 2 --zero 1)

# fivefold compare: the 5D curve is within 1e-4 of the single process's; another seed is not.
execute_process(COMMAND ${FIVEFOLD} compare --runs ${WORK}/5d,${WORK}/single --tolerance 1e-4
                        --svg ${WORK}/curves.svg
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text)
message("${text}")
if(NOT status EQUAL 0 OR NOT EXISTS ${WORK}/curves.svg)
  message(FATAL_ERROR "fivefold compare refused equal curves (exit ${status}) or wrote no SVG")
endif()
train(1 ${WORK}/other-seed --config ${preset} ${short} ${one_process} --seed 7)
execute_process(COMMAND ${FIVEFOLD} compare --runs ${WORK}/other-seed,${WORK}/single
                        --tolerance 1e-4
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text)
message("${text}")
if(status EQUAL 0)
  message(FATAL_ERROR "fivefold compare accepted another seed's curve")
endif()

# Real text through SentencePiece: a tokenizer trained on the course's READMEs, the text
# tokenized into a .bin, trained on under tp 2.
file(GLOB readmes ${ROOT}/chapters/*/README.md)
set(corpus "")
foreach(readme IN LISTS readmes)
  file(READ ${readme} text)
  string(APPEND corpus "${text}")
endforeach()
file(WRITE ${WORK}/corpus.txt "${corpus}")
execute_process(COMMAND ${FIVEFOLD} tokenize --train-tokenizer ${WORK}/course.model
                        --vocab-size 400 --input ${WORK}/corpus.txt --output ${WORK}/corpus.bin
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text)
message("${text}")
if(NOT status EQUAL 0 OR NOT EXISTS ${WORK}/corpus.bin OR NOT text MATCHES "--vocab 400")
  message(FATAL_ERROR "fivefold tokenize failed (exit ${status})")
endif()
# A bad flag is refused as every command refuses one: "fivefold tokenize: error: ...", exit 1.
execute_process(COMMAND ${FIVEFOLD} tokenize --tokenizer ${WORK}/course.model
                        --input ${WORK}/absent.txt
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text)
if(NOT status EQUAL 1 OR NOT text MATCHES "fivefold tokenize: error: --input: .*absent.txt")
  message(FATAL_ERROR "fivefold tokenize on a missing file: exit ${status}, ${text}")
endif()
train(2 ${WORK}/sentencepiece --data ${WORK}/corpus.bin --vocab 400 --tp 2 --steps 3
      --batch 4 --seq 32 --eval-every 0 --eval-batches 1 --peak-gflops 100 --no-progress)
curve(${WORK}/sentencepiece got)
list(LENGTH got rows)
if(NOT rows EQUAL 3)
  message(FATAL_ERROR "training on the tokenized corpus wrote ${rows} training rows, not 3")
endif()

# A loss that overflows (a learning rate of 1e30) stops the run naming the step, exit non-zero,
# with the last good checkpoint kept as `latest`.
set(out ${WORK}/overflow)
execute_process(COMMAND ${mpirun} -np 4 ${FIVEFOLD} train --out ${out} --tp 2 --steps 6 --batch 4
                        --seq 16 --lr 1e30 --min-lr 1e30 --warmup 1 --grad-clip 0
                        --save-every 1 --eval-every 0 --eval-batches 1 --exact-match 0
                        --synthetic-examples 300 --peak-gflops 100 --no-progress
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 120)
message("$ [4 ranks] fivefold train --lr 1e30 ... (exit ${status})\n${text}")
string(REGEX MATCH "step ([0-9]+): the loss is [^ ]+ and the gradient norm [^ ]+: not finite" said "${text}")
if(status EQUAL 0 OR NOT said)
  message(FATAL_ERROR "an overflowing run did not stop naming the step")
endif()
math(EXPR good "${CMAKE_MATCH_1} - 1")
file(READ ${out}/latest latest)
string(STRIP "${latest}" latest)
string(LENGTH "0000000${good}" n)
math(EXPR from "${n} - 8")
string(SUBSTRING "0000000${good}" ${from} 8 padded)
if(NOT latest STREQUAL "step-${padded}" OR NOT EXISTS ${out}/${latest}/model.safetensors)
  message(FATAL_ERROR "latest is '${latest}', not the last good checkpoint step-${padded}")
endif()
message("the overflow stopped the run at step ${CMAKE_MATCH_1}; latest is ${latest}")

# A finite loss with a non-finite gradient norm (2026-12-04, this layout: step 3's norm was NaN,
# its update applied and saved with 38 NaN tensors, `latest` named it, --resume refused it, and
# --keep 1 had deleted the good step 2). The step must not be applied or saved; latest must resume.
set(out ${WORK}/nan-norm)
execute_process(COMMAND ${mpirun} -np 4 ${FIVEFOLD} train --out ${out} --tp 2 --pp 2 --steps 10
                        --lr 1e6 --save-every 1 --keep 1 --d-model 32 --n-layers 2 --n-heads 4
                        --d-ff 64 --seq 16 --batch 4 --synthetic-examples 300 --eval-every 0
                        --eval-batches 1 --exact-match 0 --peak-gflops 100 --no-progress
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 120)
message("$ [4 ranks] fivefold train --tp 2 --pp 2 --lr 1e6 --keep 1 ... (exit ${status})\n${text}")
string(REGEX MATCH "step ([0-9]+): the loss is [^ ]+ and the gradient norm (-?nan|-?inf)[^ ]*: not finite, so the run stops without applying the update"
       said "${text}")
if(status EQUAL 0 OR NOT said)
  message(FATAL_ERROR "a non-finite gradient norm did not stop the run before its update")
endif()
set(bad ${CMAKE_MATCH_1})
file(READ ${out}/latest latest)
string(STRIP "${latest}" latest)
execute_process(COMMAND ${FIVEFOLD} train --out ${out} --resume --steps 10 --no-progress
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 120)
message("$ fivefold train --out ${out} --resume (exit ${status})\n${text}")
# It resumes; at this learning rate the next step overflows again, which stops it the same way.
if(text MATCHES "holds (NaN|non-finite)" OR NOT (status EQUAL 0 OR text MATCHES "step ${bad}: the loss"))
  message(FATAL_ERROR "'${latest}' did not resume")
endif()
message("the non-finite norm at step ${bad} stopped the run unsaved; ${latest} resumes")

# Refusals: on every rank, before anything is written.
refused_on_every_rank(4 ${WORK}/bad "does not divide the 4 processes" --config ${preset} ${short})
refused_on_every_rank(8 ${WORK}/bad "must split into 1 data-parallel ranks x 3 micro-batches"
                      --config ${preset} ${short} --dp 1 --accum 3)
refused_on_every_rank(2 ${WORK}/bad "not readable" --config ${WORK}/missing.toml)
file(WRITE ${WORK}/typo.toml "stpes = 4\n")
refused_on_every_rank(2 ${WORK}/bad "unknown setting 'stpes'" --config ${WORK}/typo.toml)

# Machines that do not share their files: rank 0 runs in machine-1, rank 1 in machine-2 (an
# MPMD launch, one --wdir each), each with its own data.txt and run folder at the same relative
# paths. Every process reads its own: the run is refused on both ranks, before anything is
# written, when what they read differs (the data, the checkpoint a resume starts from) and
# trains when it is the same. Shown to fail: without agree_on_inputs the first refusal trained
# (each rank on its own data, no error) and the stale checkpoint hung (rank 0 resumed from step
# 2, rank 1 from step 1 with one step more to train, waiting for rank 0 in it; killed at 60 s).
function(on_two_machines expect)
  execute_process(COMMAND ${mpirun} -np 1 --wdir ${WORK}/machine-1 ${FIVEFOLD} train ${ARGN}
                          : -np 1 --wdir ${WORK}/machine-2 ${FIVEFOLD} train ${ARGN}
                  RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 120)
  list(JOIN ARGN " " flags)
  message("$ [rank 0 in machine-1, rank 1 in machine-2] fivefold train ${flags} (exit ${status})\n${text}")
  if(expect STREQUAL "")
    if(NOT status EQUAL 0)
      message(FATAL_ERROR "expected the two machines to train")
    endif()
    return()
  endif()
  string(REGEX MATCHALL "${expect}" said "${text}")
  list(LENGTH said times)
  if(status EQUAL 0 OR times LESS 2)
    message(FATAL_ERROR "expected both ranks to refuse, saying: ${expect}")
  endif()
endfunction()
set(tiny --data data.txt --out run --steps 2 --batch 4 --seq 16 --d-model 32 --n-layers 1
    --n-heads 2 --eval-every 0 --save-every 1 --no-progress)
file(READ ${ROOT}/README.md readme)
string(SUBSTRING "${readme}" 0 4000 text)
file(WRITE ${WORK}/machine-1/data.txt "${text}")
file(WRITE ${WORK}/machine-2/data.txt "${text}.")
on_two_machines("rank 1 \\(on [^)]+\\) reads other inputs than rank 0 \\(on [^)]+\\): data 'data.txt': rank 0 4000 bytes, fnv1a [0-9a-f]+, rank 1 4001 bytes" ${tiny})
foreach(machine 1 2)
  if(EXISTS ${WORK}/machine-${machine}/run)
    message(FATAL_ERROR "the refused run wrote machine-${machine}/run")
  endif()
endforeach()
file(WRITE ${WORK}/machine-2/data.txt "${text}")
on_two_machines("" ${tiny})  # rank 0 writes machine-1/run
file(COPY ${WORK}/machine-1/run DESTINATION ${WORK}/machine-2)
file(WRITE ${WORK}/machine-2/run/latest "step-00000001\n")  # a copy a step behind
file(READ ${WORK}/machine-1/run/metrics.jsonl metrics_before)
on_two_machines("checkpoint.folder: rank 0 step-00000002, rank 1 step-00000001" ${tiny}
                --resume --steps 3)
file(REMOVE_RECURSE ${WORK}/machine-2/run)
on_two_machines("checkpoint: rank 0 [{][^}]*[}], rank 1 'run' is neither a checkpoint folder"
                ${tiny} --resume --steps 3)
file(READ ${WORK}/machine-1/run/metrics.jsonl metrics_after)
if(NOT metrics_after STREQUAL metrics_before)
  message(FATAL_ERROR "a refused resume changed machine-1/run/metrics.jsonl")
endif()
