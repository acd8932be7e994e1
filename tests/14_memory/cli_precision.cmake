# `fivefold train --precision bf16` against fp32, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch> -P cli_precision.cmake
# 200 steps of a small Llama on the synthetic corpus in fp32 and in bf16 (the products' operands
# rounded to bf16, everything else fp32): the held-out loss at every evaluation within 1% of
# fp32's (measured 2026-12-05: 0.12% at step 200, at most 1.9% between training losses), and
# the checkpoint fp32; resumed in bf16, the fp32 run says so. A bad --precision is refused on
# every rank. With master weights (notes/14_memory.md §5) a bf16 checkpoint holds the fp32
# masters: a run resumed from it takes the same steps, bit for bit, as the run never stopped.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(small --d-model 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --d-ff 192 --seq 32 --batch 8
    --synthetic-examples 2000 --eval-every 50 --eval-batches 8 --exact-match 0 --save-every 0
    --no-progress --peak-gflops 100 --steps 200)

refused_on_every_rank(2 ${WORK}/bad "precision: 'fp16' is not one of fp32, bf16"
                      --precision fp16 ${small})

foreach(precision fp32 bf16)
  train(1 ${WORK}/${precision} --precision ${precision} ${small})
  file(STRINGS ${WORK}/${precision}/metrics.jsonl rows REGEX "\"kind\":\"eval\"")
  set(held_out_${precision} "")
  foreach(row IN LISTS rows)
    string(JSON loss GET "${row}" eval_loss)
    list(APPEND held_out_${precision} ${loss})
  endforeach()
endforeach()
if(NOT train_output MATCHES "precision: bf16 products")
  message(FATAL_ERROR "the bf16 run did not say what it computes in")
endif()

list(LENGTH held_out_fp32 n)
if(n LESS 4)
  message(FATAL_ERROR "${n} evaluations in the fp32 run, expected 4")
endif()
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  list(GET held_out_fp32 ${i} want)
  list(GET held_out_bf16 ${i} got)
  execute_process(COMMAND awk "BEGIN { d = (${got} - ${want}) / ${want}; if (d < 0) d = -d; printf \"%.2e\", d; exit !(d <= 0.01 && d > 0) }"
                  OUTPUT_VARIABLE gap RESULT_VARIABLE far)
  message("evaluation ${i}: held-out loss bf16 ${got}, fp32 ${want} (relative gap ${gap})")
  if(NOT far EQUAL 0)
    message(FATAL_ERROR "bf16's held-out loss is not within 1% of fp32's (or equal to it: not bf16)")
  endif()
endforeach()

# The checkpoint is fp32 whatever the products computed in: its safetensors header says F32.
file(READ ${WORK}/bf16/step-00000200/model.safetensors header OFFSET 8 LIMIT 2000)
if(header MATCHES "BF16" OR NOT header MATCHES "F32")
  message(FATAL_ERROR "the bf16 run's checkpoint is not fp32")
endif()

# The fp32 run resumed in bf16 says so, and trains on from its step.
train(1 ${WORK}/fp32 --resume --steps 202 --precision bf16 --no-progress --peak-gflops 100)
if(NOT train_output MATCHES "precision: bf16 products[^\n]*\\(the run trained in fp32 until now\\)")
  message(FATAL_ERROR "the run resumed in bf16 did not say that its precision changed")
endif()

# A bf16 run with ZeRO-2 over 2 ranks (its masters sharded), saved at step 2 and resumed from that
# checkpoint in a fresh folder: every step equal, digit for digit, to the uninterrupted run's.
# Resumed from the parameters' bf16 rounding instead of the masters, the steps after differ.
set(mixed --precision bf16 --batch 8 --seq 16 --d-model 32 --n-layers 2 --n-heads 4
    --n-kv-heads 2 --d-ff 64 --synthetic-examples 300 --warmup 1 --grad-clip 0.5 --eval-every 0
    --exact-match 0 --eval-batches 1 --peak-gflops 100 --no-progress)
train(2 ${WORK}/mixed ${mixed} --zero 2 --steps 4 --save-every 2)
curve(${WORK}/mixed whole)
list(LENGTH whole n)
if(NOT n EQUAL 4)
  message(FATAL_ERROR "the bf16 run has ${n} training rows, expected 4")
endif()
expect_resumed(2 ${WORK}/mixed ${WORK}/mixed-resumed whole
               "bf16 with master weights (ZeRO-2, 2 ranks), resumed at step 2: equal to the uninterrupted run"
               --precision bf16 --zero 2 --save-every 0 TOLERANCE 0)

# The same checkpoint resumed in another layout, one process: the masters and AdamW's state carry
# over, and the curve goes on within bf16's rounding of the gradients (each layout rounds its own):
# within 1e-3 (measured 2026-12-06: 1.9e-4 on step 3's gradient norm, 2e-6 on step 4's loss).
expect_resumed(1 ${WORK}/mixed ${WORK}/mixed-one whole
               "bf16 saved on 2 ranks (ZeRO-2), resumed on one process"
               --precision bf16 --zero 0 --save-every 0 TOLERANCE 1e-3)
